// DaemonProcess: starts the real `flashd serve` binary for end-to-end tests, in a private
// temporary directory, and waits for its "flashd ready:" line.
//
// Each instance gets its own state dir, socket and pid file under `dir()`, and TCP port 0 (a
// free port chosen by the kernel, read back from the ready line), so tests can run in parallel.
#pragma once

#include <httplib.h>
#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/temp_dir.h"

namespace flashd::testing {

// The flashd binary, the source tree and the golden model directory the tests use: the build's
// (compiled in), or, for binaries carried to another machine (tests/gpu/run-on-device.sh),
// FLASHD_TEST_BINARY, FLASHD_TEST_SOURCE_DIR and FLASHD_TEST_GOLDEN_DIR.
std::string DaemonBinary();
std::string SourceDir();
std::string GoldenDir();

// A tiny model in the released format, written once per test binary with `flashd mkmodel`
// (the golden tests' 480-token tokenizer, so it takes a fraction of a second), shared by every
// daemon a test starts.
const std::string& SharedTinyModelDir();

// Polls GET /health until it answers 200 or `timeout` passes; returns the last status.
int WaitHealthy(const std::string& host, int port,
                std::chrono::seconds timeout = std::chrono::seconds(60));

// The value of an unlabelled metric from the client's GET /metrics, or -1.
double Metric(httplib::Client& client, const std::string& name);

class DaemonProcess {
 public:
  struct Options {
    std::filesystem::path dir;               // Holds state/, run/ and the log.
    std::string config_yaml;                 // Written to dir/flashd.yaml when not empty.
    std::map<std::string, std::string> env;  // Extra environment (overrides the defaults).
    std::vector<std::string> args;           // Extra arguments after "serve".
  };

  explicit DaemonProcess(Options options);
  ~DaemonProcess();  // Kills the process if still running.

  // Starts the binary; returns false if it exited before printing its ready line (then
  // exit_code() and log() say why) or did not get ready within `timeout`.
  bool Start(std::chrono::seconds timeout = std::chrono::seconds(60));

  // Sends `signal` and waits for the exit; returns the exit code (128+N if killed by signal N),
  // or -1 if it did not exit within `timeout`.
  int Stop(int signal, std::chrono::seconds timeout = std::chrono::seconds(30));

  // Waits for an exit that the process makes by itself (after a failed start).
  int Wait(std::chrono::seconds timeout = std::chrono::seconds(30));

  // A command the binary runs under, e.g. {"/usr/bin/prlimit", "--fsize=1000000"}.
  void set_wrapper(std::vector<std::string> wrapper) { wrapper_ = std::move(wrapper); }

  pid_t pid() const { return pid_; }
  int port() const { return port_; }
  std::string socket_path() const;
  std::string pid_file() const;
  std::string log() const;  // Everything the daemon wrote to stderr.
  int exit_code() const { return exit_code_; }

 private:
  Options options_;
  std::vector<std::string> wrapper_;
  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  int port_ = -1;
  int exit_code_ = -1;
};

// Clients of a started daemon's TCP listener and Unix socket.
std::unique_ptr<httplib::Client> TcpClient(const DaemonProcess& d, int read_timeout_s = 120);
std::unique_ptr<httplib::Client> UnixClient(const DaemonProcess& d, int read_timeout_s = 120);

}  // namespace flashd::testing
