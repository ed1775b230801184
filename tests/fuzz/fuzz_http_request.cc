// Raw bytes on a connection, through httplib's request parsing and every flashd route, as both
// listeners serve them (no model loaded: generation routes answer 503 after their checks).
// Several requests may follow one another on the connection.
#include <httplib.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "config/config.h"
#include "tools-api/api.h"

using namespace flashd;

namespace {

class MemoryStream : public httplib::Stream {
 public:
  MemoryStream(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool is_readable() const override { return at_ < size_; }
  bool is_writable() const override { return true; }
  ssize_t read(char* ptr, size_t size) override {
    const size_t n = std::min(size, size_ - at_);
    std::memcpy(ptr, data_ + at_, n);
    at_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char*, size_t size) override { return static_cast<ssize_t>(size); }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = "127.0.0.1";
    port = 40000;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip = "127.0.0.1";
    port = 8741;
  }
  socket_t socket() const override { return -1; }
  bool done() const { return at_ >= size_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

class FuzzServer : public httplib::Server {
 public:
  bool Serve(httplib::Stream& s, bool& closed) {
    return process_request(s, false, closed, nullptr);
  }
};

struct Daemon {
  Config config;
  std::unique_ptr<api::Api> api;
  FuzzServer server;
  Daemon() {
    config.auth.keys["alice"] = "alice-key-0123456789";
    config.server.cors_origins = {"https://ide.example.com"};
    api = std::make_unique<api::Api>(config, api::ServedModel{"m", "fuzz", true, 0});
    api->SetPhase(api::Phase::kReady, "");
    api->Install(&server, "tcp");
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Daemon* d = new Daemon();
  MemoryStream stream(data, size);
  for (int i = 0; i < 8 && !stream.done(); ++i) {
    bool closed = false;
    if (!d->server.Serve(stream, closed) || closed) break;
  }
  return 0;
}
