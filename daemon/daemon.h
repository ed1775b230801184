// Daemon: the running `flashd serve` process. Owns the listeners, the API, the pid file and the
// signal loop.
//
// Start() binds every listener (so a conflict is reported before anything else happens) and
// starts serving; Run() blocks on the main thread until SIGTERM or SIGINT, then drains in-flight
// responses for up to server.shutdown_grace_seconds and removes the socket and pid files. SIGHUP
// reads the config file again and applies what can change without dropping the model: the log
// level, auth.keys, auth.groups, auth.admins and the cache's quota, TTL and RAM size; other
// changed keys are named in the log as needing a restart.
#pragma once

#include <httplib.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cache/block_store.h"
#include "cache/catalog.h"
#include "config/config.h"
#include "config/status.h"
#include "engine/engine.h"
#include "tools-api/api.h"

namespace flashd::daemon {

class Daemon {
 public:
  // REQUIRES: PrepareDirectories(config) succeeded.
  // `config_path` is read again on SIGHUP ("" when the config is the built-in defaults).
  static StatusOr<std::unique_ptr<Daemon>> Start(const Config& config,
                                                 std::string config_path = "");
  ~Daemon();

  // Blocks until a shutdown signal and returns the process exit code.
  int Run();

  // The TCP port actually bound (useful when the config asked for port 0); -1 without TCP.
  int tcp_port() const { return tcp_port_; }

 private:
  explicit Daemon(const Config& config);
  Status Bind();
  // Listening sockets passed by systemd (flashd.socket): at most one Unix and one TCP socket;
  // -1 where none was passed.
  Status AdoptSystemdSockets(int* tcp_fd, int* unix_fd);
  void WritePidFile();
  // Reads the model's weight files once, with progress on /health (see daemon.cc).
  Status ReadModelFiles(const std::string& dir);
  // SIGHUP: applies the reloadable part of the config file; logs what it did or why not.
  void Reload();
  void RemoveFiles();
  bool StopListeners(int grace_seconds);
  // Runs on loader_: writes the embedded default model if needed, then loads the model and
  // reports the outcome through the API's phase.
  void LoadModel();
  // Opens the prefix cache (state_dir/cache) and its catalog (state_dir/catalog.db).
  Status OpenCache();

  const Config config_;
  // The configuration in force after reloads: touched only by Run()'s signal loop.
  Config applied_;
  std::unique_ptr<api::Api> api_;
  std::unique_ptr<httplib::Server> tcp_;
  std::unique_ptr<httplib::Server> unix_;
  std::vector<std::thread> threads_;
  std::thread loader_;
  std::atomic<bool> load_finished_{false};
  // Written by loader_ before load_finished_ is set; read by the metrics hook after that.
  std::shared_ptr<cache::BlockStore> cache_;
  std::unique_ptr<cache::Catalog> catalog_;
  std::string cache_error_;
  std::unique_ptr<engine::Engine> engine_;
  int tcp_port_ = -1;
  std::string config_path_;
  std::string listen_host_;  // What the TCP listener is bound to (config, or systemd's socket).
  std::string socket_path_;  // The Unix socket's path (config, or systemd's socket).
  bool own_socket_file_ = false;
  bool own_pid_file_ = false;
};

}  // namespace flashd::daemon
