#include "daemon/unix_socket.h"

#include <errno.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <vector>

namespace flashd::daemon {

Status ClaimSocketPath(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status::Ok();
    return IoError("server.socket: cannot stat \"" + path + "\": " + std::strerror(errno));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return FailedPrecondition("server.socket: \"" + path +
                              "\" exists and is not a socket; refusing to remove it");
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return InvalidArgument("server.socket: path longer than " +
                           std::to_string(sizeof(addr.sun_path) - 1) + " bytes");
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return IoError(std::string("socket(): ") + std::strerror(errno));
  int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  ::close(fd);
  if (rc == 0) {
    return FailedPrecondition("another flashd is already serving on \"" + path +
                              "\"; stop it first or set server.socket (FLASHD_SOCKET) elsewhere");
  }
  if (err != ECONNREFUSED) {
    return IoError("server.socket: cannot probe \"" + path + "\": " + std::strerror(err));
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return IoError("server.socket: cannot remove stale socket \"" + path +
                   "\": " + std::strerror(errno));
  }
  return Status::Ok();
}

Status SetSocketPermissions(const std::string& path, unsigned mode, const std::string& group) {
  if (!group.empty()) {
    std::vector<char> buf(16384);
    struct group entry;
    struct group* found = nullptr;
    int rc = ::getgrnam_r(group.c_str(), &entry, buf.data(), buf.size(), &found);
    if (rc != 0 || found == nullptr) {
      return InvalidArgument("server.socket_group: no group named \"" + group + "\"");
    }
    if (::chown(path.c_str(), static_cast<uid_t>(-1), found->gr_gid) != 0) {
      return IoError("server.socket_group: cannot chown \"" + path + "\": " + std::strerror(errno));
    }
  }
  if (::chmod(path.c_str(), mode) != 0) {
    return IoError("server.socket_mode: cannot chmod \"" + path + "\": " + std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace flashd::daemon
