#include "tests/e2e/daemon_process.h"

#include <fcntl.h>
#include <httplib.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

namespace flashd::testing {
namespace fs = std::filesystem;

namespace {
std::string FromEnv(const char* name, const char* built) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : built;
}
}  // namespace

std::string DaemonBinary() { return FromEnv("FLASHD_TEST_BINARY", FLASHD_BINARY); }
std::string SourceDir() { return FromEnv("FLASHD_TEST_SOURCE_DIR", FLASHD_SOURCE_DIR); }
std::string GoldenDir() { return FromEnv("FLASHD_TEST_GOLDEN_DIR", FLASHD_GOLDEN_DIR); }

const std::string& SharedTinyModelDir() {
  static TempDir* dir = new TempDir();  // Removed at exit by the OS-level temp cleanup below.
  static const std::string path = [] {
    std::string model = (dir->path() / "tiny-model").string();
    std::string cmd = DaemonBinary() + " mkmodel " + model + " --tokenizer " + GoldenDir() +
                      " --set vocab_size=480"
                      " --set engram_compressed_vocab_size=389 --set dspark_noise_token_id=400"
                      " --seed 3 "
                      "> /dev/null";
    if (std::system(cmd.c_str()) != 0) return std::string();
    std::atexit([] { delete dir; });
    return model;
  }();
  return path;
}

double Metric(httplib::Client& client, const std::string& name) {
  auto m = client.Get("/metrics");
  if (!m) return -1;
  const std::string needle = "\n" + name + " ";
  const size_t at = m->body.find(needle);
  if (at == std::string::npos) return -1;
  return std::stod(m->body.substr(at + needle.size()));
}

int WaitHealthy(const std::string& host, int port, std::chrono::seconds timeout) {
  httplib::Client client(host, port);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = -1;
  while (std::chrono::steady_clock::now() < deadline) {
    auto res = client.Get("/health");
    status = res ? res->status : -1;
    if (status == 200) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return status;
}

DaemonProcess::DaemonProcess(Options options) : options_(std::move(options)) {}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0 && exit_code_ < 0) Stop(SIGKILL, std::chrono::seconds(10));
  if (stdout_fd_ >= 0) ::close(stdout_fd_);
}

std::string DaemonProcess::socket_path() const {
  auto it = options_.env.find("FLASHD_SOCKET");
  if (it != options_.env.end()) return it->second;
  return (options_.dir / "run" / "flashd.sock").string();
}

std::string DaemonProcess::pid_file() const {
  return (options_.dir / "run" / "flashd.pid").string();
}

std::string DaemonProcess::log() const {
  std::ifstream in(options_.dir / "daemon.log");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool DaemonProcess::Start(std::chrono::seconds timeout) {
  std::map<std::string, std::string> env = {
      {"FLASHD_LISTEN", "127.0.0.1:0"},
      {"FLASHD_SOCKET", (options_.dir / "run" / "flashd.sock").string()},
      {"FLASHD_STATE_DIR", (options_.dir / "state").string()},
      {"FLASHD_LOG_LEVEL", "info"},
      {"FLASHD_MODEL_DIR", SharedTinyModelDir()},
  };
  for (const auto& [k, v] : options_.env) env[k] = v;
  options_.env = env;

  std::vector<std::string> args = wrapper_;
  args.push_back(DaemonBinary());
  args.push_back("serve");
  std::string config = options_.config_yaml;
  if (config.empty()) {
    config = "server:\n  pid_file: " + pid_file() + "\n  shutdown_grace_seconds: 5\n";
  }
  std::ofstream(options_.dir / "flashd.yaml") << config;
  args.push_back("--config");
  args.push_back((options_.dir / "flashd.yaml").string());
  for (const std::string& a : options_.args) args.push_back(a);

  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return false;
  std::string log_path = (options_.dir / "daemon.log").string();
  pid_ = ::fork();
  if (pid_ == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (log_fd >= 0) ::dup2(log_fd, STDERR_FILENO);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(out[1]);
  stdout_fd_ = out[0];

  // Read stdout until the ready line or EOF (the daemon exited) or the timeout.
  std::string buffer;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{stdout_fd_, POLLIN, 0};
    int rc = ::poll(&p, 1, 100);
    if (rc > 0) {
      char chunk[512];
      ssize_t n = ::read(stdout_fd_, chunk, sizeof chunk);
      if (n <= 0) break;
      buffer.append(chunk, static_cast<size_t>(n));
      size_t at = buffer.find("flashd ready:");
      if (at != std::string::npos && buffer.find('\n', at) != std::string::npos) {
        size_t http = buffer.find("http://", at);
        if (http != std::string::npos) {
          size_t colon = buffer.find(':', http + 7);
          port_ = std::atoi(buffer.c_str() + colon + 1);
        }
        return true;
      }
    }
  }
  Wait(std::chrono::seconds(5));
  return false;
}

int DaemonProcess::Wait(std::chrono::seconds timeout) {
  if (pid_ <= 0) return -1;
  if (exit_code_ >= 0) return exit_code_;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

int DaemonProcess::Stop(int signal, std::chrono::seconds timeout) {
  if (pid_ <= 0) return -1;
  if (exit_code_ >= 0) return exit_code_;
  ::kill(pid_, signal);
  int code = Wait(timeout);
  if (code < 0) {
    ::kill(pid_, SIGKILL);
    Wait(std::chrono::seconds(10));
  }
  return code;
}

std::unique_ptr<httplib::Client> TcpClient(const DaemonProcess& d, int read_timeout_s) {
  auto c = std::make_unique<httplib::Client>("127.0.0.1", d.port());
  c->set_read_timeout(read_timeout_s);
  return c;
}

std::unique_ptr<httplib::Client> UnixClient(const DaemonProcess& d, int read_timeout_s) {
  auto c = std::make_unique<httplib::Client>(d.socket_path());
  c->set_address_family(AF_UNIX);
  c->set_read_timeout(read_timeout_s);
  return c;
}

}  // namespace flashd::testing
