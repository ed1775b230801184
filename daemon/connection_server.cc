#include "daemon/connection_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

#include "tools-api/api.h"

namespace flashd::daemon {
namespace {

// Waits up to `timeout_ms` for `events` on `sock`; true when they came.
bool WaitFor(int sock, short events, int timeout_ms) {
  pollfd p{sock, events, 0};
  for (;;) {
    const int r = ::poll(&p, 1, timeout_ms);
    if (r < 0 && errno == EINTR) continue;
    return r > 0;
  }
}

int Millis(time_t sec, time_t usec) { return static_cast<int>(sec * 1000 + usec / 1000); }

// One connection's socket with a read buffer that lives as long as the connection, so bytes
// read past the end of one request (the next, pipelined request) are there for the next.
class ConnectionStream : public httplib::Stream {
 public:
  ConnectionStream(int sock, int read_timeout_ms, int write_timeout_ms)
      : sock_(sock), read_timeout_ms_(read_timeout_ms), write_timeout_ms_(write_timeout_ms) {}

  bool buffered() const { return begin_ < end_; }

  bool is_readable() const override {
    return buffered() || WaitFor(sock_, POLLIN, read_timeout_ms_);
  }
  bool is_writable() const override { return WaitFor(sock_, POLLOUT, write_timeout_ms_); }

  ssize_t read(char* ptr, size_t size) override {
    if (!buffered()) {
      if (!WaitFor(sock_, POLLIN, read_timeout_ms_)) return -1;
      ssize_t n;
      do {
        n = ::recv(sock_, buf_, sizeof buf_, 0);
      } while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      begin_ = 0;
      end_ = static_cast<size_t>(n);
    }
    const size_t n = std::min(size, end_ - begin_);
    std::memcpy(ptr, buf_ + begin_, n);
    begin_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t n;
    do {
      n = ::send(sock_, ptr, size, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    if (::getpeername(sock_, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
      Describe(addr, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    if (::getsockname(sock_, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
      Describe(addr, ip, port);
  }
  socket_t socket() const override { return sock_; }

 private:
  static void Describe(const sockaddr_storage& addr, std::string& ip, int& port) {
    char text[INET6_ADDRSTRLEN] = {};
    if (addr.ss_family == AF_INET) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
      ::inet_ntop(AF_INET, &a->sin_addr, text, sizeof text);
      port = ntohs(a->sin_port);
    } else if (addr.ss_family == AF_INET6) {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
      ::inet_ntop(AF_INET6, &a->sin6_addr, text, sizeof text);
      port = ntohs(a->sin6_port);
    } else {
      port = 0;
    }
    ip = text;
  }

  int sock_;
  int read_timeout_ms_;
  int write_timeout_ms_;
  char buf_[16 * 1024];
  size_t begin_ = 0;
  size_t end_ = 0;
};

class ConnectionServer : public httplib::Server {
 public:
  explicit ConnectionServer(Listener listener) : listener_(listener) {}

  // httplib's accept loop runs on svr_sock_; bind_to_port() would have set it.
  void Adopt(int fd) { svr_sock_ = fd; }

 private:
  bool process_and_close_socket(socket_t sock) override {
    api::Peer& peer = api::CurrentPeer();
    peer = api::Peer{};
    if (listener_ == Listener::kUnix) {
      ucred cred{};
      socklen_t len = sizeof cred;
      if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 && len == sizeof cred) {
        peer.known = true;
        peer.uid = cred.uid;
        peer.pid = cred.pid;
      }
    } else {
      const int on = 1;
      ::setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
    }
    const bool ok = Serve(sock);
    peer = api::Peer{};
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ok;
  }

  bool Serve(int sock) {
    ConnectionStream stream(sock, Millis(read_timeout_sec_, read_timeout_usec_),
                            Millis(write_timeout_sec_, write_timeout_usec_));
    const auto setup = [&stream](httplib::Request& req) {
      // Ranges are for fetching parts of a document; on anything but GET they would cut a
      // generated answer.
      if (req.method != "GET" && req.method != "HEAD") req.ranges.clear();
      stream.get_remote_ip_and_port(req.remote_addr, req.remote_port);
    };
    bool ok = false;
    for (size_t left = keep_alive_max_count_; left > 0; --left) {
      if (!stream.buffered() && !WaitForRequest(sock)) break;
      bool closed = false;
      ok = process_request(stream, /*close_connection=*/left == 1, closed, setup);
      if (!ok || closed) break;
    }
    return ok;
  }

  // Waits for the next request of a kept-alive connection, looking every 100 ms whether the
  // server is stopping, so stop() never waits out an idle client.
  bool WaitForRequest(int sock) const {
    const auto end =
        std::chrono::steady_clock::now() + std::chrono::seconds(keep_alive_timeout_sec_);
    while (svr_sock_ != INVALID_SOCKET) {
      if (WaitFor(sock, POLLIN, 100)) return true;
      if (std::chrono::steady_clock::now() >= end) return false;
    }
    return false;
  }

  Listener listener_;
};

}  // namespace

std::unique_ptr<httplib::Server> MakeConnectionServer(Listener listener) {
  return std::make_unique<ConnectionServer>(listener);
}

void AdoptListeningSocket(httplib::Server* server, int fd) {
  static_cast<ConnectionServer*>(server)->Adopt(fd);
}

}  // namespace flashd::daemon
