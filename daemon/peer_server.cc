#include "daemon/peer_server.h"

#include <dlfcn.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include "tools-api/api.h"

namespace flashd::daemon {
namespace {

// httplib::Server::process_and_close_socket(int): the member function's own code, called as the
// platform's C++ ABI calls a non-virtual member function (the object first).
using ServeConnection = bool (*)(httplib::Server*, int);

ServeConnection HttplibServeConnection() {
  static const ServeConnection fn = reinterpret_cast<ServeConnection>(
      dlsym(RTLD_DEFAULT, "_ZN7httplib6Server24process_and_close_socketEi"));
  return fn;
}

class PeerServer : public httplib::Server {
 private:
  bool process_and_close_socket(socket_t sock) override {
    ucred cred{};
    socklen_t len = sizeof cred;
    api::Peer& peer = api::CurrentPeer();
    peer = api::Peer{};
    if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && len == sizeof cred) {
      peer.known = true;
      peer.uid = cred.uid;
      peer.pid = cred.pid;
    }
    const bool ok = HttplibServeConnection()(this, sock);
    peer = api::Peer{};
    return ok;
  }
};

}  // namespace

std::unique_ptr<httplib::Server> MakeUnixServer() {
  if (HttplibServeConnection() == nullptr) {
    spdlog::warn(
        "this httplib build does not export its connection handler: socket requests cannot be "
        "told apart by user and share one tenant");
    return std::make_unique<httplib::Server>();
  }
  return std::make_unique<PeerServer>();
}

}  // namespace flashd::daemon
