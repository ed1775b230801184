#include "daemon/daemon.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>
#include <uv.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "daemon/connection_server.h"
#include "daemon/task_queue.h"
#include "daemon/unix_socket.h"
#include "engine/model_files.h"
#include "engine/safetensors.h"
#include "engine/tokenizer.h"

namespace flashd::daemon {
namespace {

constexpr const char* kEmbeddedDescription =
    "embedded default tiny model with random weights: it exercises the whole daemon and writes "
    "meaningless text; real answers need the released DeepSeek-V4.1-Flash checkpoint";

api::ServedModel DescribeModel(const Config& config) {
  api::ServedModel m;
  m.id = config.model.id;
  m.embedded_default = config.model.dir.empty();
  m.description =
      m.embedded_default ? kEmbeddedDescription : "DeepSeek-V4.1-Flash from " + config.model.dir;
  m.created = static_cast<int64_t>(std::time(nullptr));
  return m;
}

std::unique_ptr<httplib::Server> MakeServer(const Config& config, bool unix_socket = false) {
  auto server = MakeConnectionServer(unix_socket ? Listener::kUnix : Listener::kTcp);
  const size_t threads = static_cast<size_t>(config.server.http_threads);
  // Streams hold their worker; more workers start while none is idle (task_queue.h).
  server->new_task_queue = [threads] { return new ElasticTaskQueue(threads, 4096); };
  server->set_keep_alive_max_count(1000);
  return server;
}

}  // namespace

Daemon::Daemon(const Config& config) : config_(config), applied_(config) {}

Daemon::~Daemon() {
  StopListeners(-1);
  if (loader_.joinable()) loader_.join();
  RemoveFiles();
}

StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const Config& config, std::string config_path) {
  std::unique_ptr<Daemon> d(new Daemon(config));
  d->config_path_ = std::move(config_path);
  d->api_ = std::make_unique<api::Api>(config, DescribeModel(config));
  FLASHD_RETURN_IF_ERROR(d->Bind());
  d->WritePidFile();
  for (httplib::Server* s : {d->tcp_.get(), d->unix_.get()}) {
    if (s != nullptr) d->threads_.emplace_back([s] { s->listen_after_bind(); });
  }
  d->api_->SetPhase(api::Phase::kLoading, "loading the model");
  d->loader_ = std::thread([raw = d.get()] { raw->LoadModel(); });
  return d;
}

Status Daemon::AdoptSystemdSockets(int* tcp_fd, int* unix_fd) {
  *tcp_fd = *unix_fd = -1;
  const int n = sd_listen_fds(/*unset_environment=*/1);
  if (n <= 0) return Status::Ok();
  for (int fd = SD_LISTEN_FDS_START; fd < SD_LISTEN_FDS_START + n; ++fd) {
    if (sd_is_socket_unix(fd, SOCK_STREAM, 1, nullptr, 0) > 0 && *unix_fd < 0) {
      *unix_fd = fd;
    } else if (sd_is_socket_inet(fd, AF_UNSPEC, SOCK_STREAM, 1, 0) > 0 && *tcp_fd < 0) {
      *tcp_fd = fd;
    } else {
      return InvalidArgument("socket activation: inherited fd " + std::to_string(fd) +
                             " is not a listening stream socket (Unix or TCP) flashd can serve, "
                             "or a second one of its kind");
    }
  }
  spdlog::info("socket activation: serving {} inherited socket(s)", n);
  return Status::Ok();
}

Status Daemon::Bind() {
  const ServerConfig& sc = config_.server;
  int tcp_fd = -1, unix_fd = -1;
  FLASHD_RETURN_IF_ERROR(AdoptSystemdSockets(&tcp_fd, &unix_fd));
  if (tcp_fd >= 0) {
    // systemd's flashd.socket decides the address: server.listen is not bound.
    tcp_ = MakeServer(config_);
    api_->Install(tcp_.get(), "tcp");
    AdoptListeningSocket(tcp_.get(), tcp_fd);
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    ::getsockname(tcp_fd, reinterpret_cast<sockaddr*>(&addr), &len);
    char host[INET6_ADDRSTRLEN] = {};
    if (addr.ss_family == AF_INET6) {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
      ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
      tcp_port_ = ntohs(a->sin6_port);
    } else {
      const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
      ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
      tcp_port_ = ntohs(a->sin_port);
    }
    listen_host_ = host;
  }
  if (unix_fd >= 0) {
    // The socket file is systemd's (its path, mode and group are in flashd.socket).
    unix_ = MakeServer(config_, /*unix_socket=*/true);
    unix_->set_address_family(AF_UNIX);
    api_->Install(unix_.get(), "unix");
    AdoptListeningSocket(unix_.get(), unix_fd);
    sockaddr_un addr{};
    socklen_t len = sizeof addr;
    ::getsockname(unix_fd, reinterpret_cast<sockaddr*>(&addr), &len);
    socket_path_ = addr.sun_path;
  }
  if (tcp_fd >= 0 || unix_fd >= 0) return Status::Ok();
  // The socket is claimed first: a second daemon must say "already running", not "port in use".
  if (!sc.socket_path.empty()) FLASHD_RETURN_IF_ERROR(ClaimSocketPath(sc.socket_path));

  listen_host_ = sc.listen_host;
  socket_path_ = sc.socket_path;
  if (sc.listen_enabled) {
    tcp_ = MakeServer(config_);
    api_->Install(tcp_.get(), "tcp");
    if (sc.listen_port == 0) {
      tcp_port_ = tcp_->bind_to_any_port(sc.listen_host);
    } else if (tcp_->bind_to_port(sc.listen_host, sc.listen_port)) {
      tcp_port_ = sc.listen_port;
    }
    if (tcp_port_ <= 0) {
      return IoError(config_.Where("server.listen") + ": cannot listen on " + sc.listen_host + ":" +
                     std::to_string(sc.listen_port) +
                     " (address in use, or not an address of this machine)");
    }
  }

  if (!sc.socket_path.empty()) {
    unix_ = MakeServer(config_, /*unix_socket=*/true);
    unix_->set_address_family(AF_UNIX);
    api_->Install(unix_.get(), "unix");
    // Nobody may connect between bind() and chmod(): create the file with no access at all.
    mode_t old_mask = ::umask(0777);
    bool bound = unix_->bind_to_port(sc.socket_path, 80);
    ::umask(old_mask);
    if (!bound) {
      return IoError(config_.Where("server.socket") + ": cannot bind Unix socket \"" +
                     sc.socket_path + "\"");
    }
    own_socket_file_ = true;
    FLASHD_RETURN_IF_ERROR(SetSocketPermissions(sc.socket_path, sc.socket_mode, sc.socket_group));
  }
  return Status::Ok();
}

void Daemon::LoadModel() {
  std::string dir = config_.model.dir;
  if (dir.empty()) {
    api_->SetPhase(api::Phase::kLoading, "writing the embedded default model");
    const std::string tokenizer_dir = config_.model.tokenizer_dir.empty()
                                          ? engine::FindDefaultTokenizerDir()
                                          : config_.model.tokenizer_dir;
    const auto start = std::chrono::steady_clock::now();
    Status s = engine::EnsureDefaultModel(
        config_.state_dir, tokenizer_dir, [this, start](uint64_t done, uint64_t total) {
          api_->SetProgress(
              "writing the embedded default model", "parameters", done, total,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        });
    if (!s.ok()) {
      spdlog::error("embedded default model: {}", s.message());
      api_->SetPhase(api::Phase::kFailed, "embedded default model: " + s.message());
      load_finished_ = true;
      return;
    }
    dir = engine::DefaultModelDir(config_.state_dir);
  }
  api_->SetPhase(api::Phase::kLoading, "loading the model from " + dir);
  if (Status s = ReadModelFiles(dir); !s.ok()) {
    spdlog::error("cannot load the model: {}", s.message());
    api_->SetPhase(api::Phase::kFailed, "cannot load the model: " + s.message());
    load_finished_ = true;
    return;
  }
  engine::EngineOptions options;
  static_cast<EngineConfig&>(options) = config_.engine;
  options.model_dir = dir;
  options.block_tokens = config_.cache.block_tokens;
  if (Status s = OpenCache(); !s.ok()) {
    // Serving without the cache beats not serving: every prompt is prefilled, /health says so.
    spdlog::error("prefix cache unavailable, prefilling every prompt: {}", s.message());
    cache_error_ = s.message();
  }
  options.cache = cache_;
  const auto upload_start = std::chrono::steady_clock::now();
  options.upload_progress = [this, upload_start](uint64_t done, uint64_t total) {
    api_->SetProgress(
        "uploading the weights to the GPU", "bytes", done, total,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - upload_start).count());
  };
  api_->SetCatalog(catalog_.get());
  auto engine = engine::Engine::Open(options);
  if (!engine.ok()) {
    // The daemon stays up so that the operator can read why from /health and the log.
    spdlog::error("cannot load the model: {}", engine.status().message());
    api_->SetPhase(api::Phase::kFailed, "cannot load the model: " + engine.status().message());
    load_finished_ = true;
    return;
  }
  engine_ = std::move(*engine);
  if (cache_) {
    // What losing a snapshot costs, in blocks: the replay its miss causes.
    cache_->SetSnapshotCost(static_cast<double>(engine_->exact_replay_tokens()) /
                            static_cast<double>(engine_->block_tokens()));
  }
  if (engine_->tokenizer() != nullptr) {
    spdlog::info("tokenizer: {} ids", engine_->tokenizer()->size());
  } else {
    spdlog::warn("model {} has no tokenizer.json: /tokenize and generation are unavailable", dir);
  }
  api_->SetEngine(engine_.get());
  api_->SetPhase(api::Phase::kReady, "");
  sd_notify(0, "STATUS=serving; model loaded");
  load_finished_ = true;
}

Status Daemon::ReadModelFiles(const std::string& dir) {
  // The weights are memory-mapped; reading them once here, on several threads, brings them into
  // the page cache before the first request instead of page by page during it, and shows how
  // far loading is (/health). Skipped when they would not fit in half the free memory (the
  // kernel would only evict them again), unless model.verify asks for every byte to be checked
  // against SHA256SUMS.
  StatusOr<std::vector<std::string>> files = engine::CheckpointFiles(dir);
  if (!files.ok()) return Status::Ok();  // The loader says why, after the config's checks.
  uint64_t total = 0;
  std::error_code ec;
  for (const std::string& f : *files) total += std::filesystem::file_size(f, ec);
  const long pages = ::sysconf(_SC_AVPHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  const uint64_t free_bytes = pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : 0;
  const bool verify = config_.model.verify;
  if (total > free_bytes / 2 && !verify) {
    spdlog::info("model files ({:.1f} GiB) exceed half the free memory: read on demand",
                 total / 1073741824.0);
    return Status::Ok();
  }
  const auto start = std::chrono::steady_clock::now();
  engine::ReadFilesOptions o;
  o.progress = [&](uint64_t done, uint64_t all) {
    api_->SetProgress(
        verify ? "reading and checking the model files" : "reading the model files", "bytes", done,
        all, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  };
  engine::FilesRead read;
  if (verify) {
    FLASHD_RETURN_IF_ERROR(engine::VerifyModelFiles(dir, o, &read));
  } else {
    FLASHD_ASSIGN_OR_RETURN(read, engine::ReadFiles(*files, o));
  }
  spdlog::info("read {} model files{}, {:.1f} MiB in {:.2f} s ({:.0f} MB/s)", files->size(),
               verify ? " (SHA-256 checked against SHA256SUMS)" : "", read.bytes / 1048576.0,
               read.seconds, read.seconds > 0 ? read.bytes / read.seconds / 1e6 : 0.0);
  return Status::Ok();
}

Status Daemon::OpenCache() {
  cache::StoreOptions o;
  o.dir = (std::filesystem::path(config_.state_dir) / "cache").string();
  o.ram_bytes = config_.cache.ram_bytes;
  o.disk_quota_bytes = config_.cache.disk_quota_bytes;
  o.ttl_seconds = config_.cache.ttl_seconds;
  o.eviction = config_.cache.eviction == "cost" ? cache::StoreOptions::Eviction::kCost
                                                : cache::StoreOptions::Eviction::kLru;
  o.payload_format = engine::Engine::kCachePayloadFormat;
  const std::string catalog_path =
      (std::filesystem::path(config_.state_dir) / "catalog.db").string();
  auto catalog = cache::Catalog::Open(catalog_path);
  auto opened = cache::BlockStore::Open(o);
  if (!opened.ok()) {
    // Without the block store (a full disk at start, say) sessions still work from the catalog:
    // every turn renders its whole conversation anyway.
    if (catalog.ok()) catalog_ = std::move(*catalog);
    return opened.status();
  }
  auto store = std::move(*opened);
  if (const auto& dropped = store->dropped_at_open()) {
    spdlog::warn(
        "prefix cache {}: {} entries ({:.1f} MiB) were written in an older format ({}); this "
        "build writes '{}', so they were dropped and their prefixes will be prefilled again",
        o.dir, dropped->entries, dropped->bytes / 1048576.0,
        dropped->format.empty() ? "unrecorded" : "'" + dropped->format + "'", o.payload_format);
  }
  if (!catalog.ok()) {
    // The cache serves without it; sessions and pins wait for the operator, and the file is left
    // as it is (to restore from a backup, or to inspect).
    spdlog::error("catalog {} cannot be used ({}): sessions and pins are unavailable", catalog_path,
                  catalog.status().message());
    cache_ = std::shared_ptr<cache::BlockStore>(std::move(store));
    return Status::Ok();
  }
  catalog_ = std::move(*catalog);
  // Start-up reconciliation: a pin whose blocks are gone (evicted before it was pinned, or lost)
  // is dropped; the rest are pinned again.
  for (const cache::Catalog::Pin& pin : catalog_->Pins()) {
    if (store->PresentPrefix(pin.chain) == pin.chain.size()) {
      store->Pin(pin.chain);
      store->Pin(std::span(&pin.snapshot, 1));
    } else {
      spdlog::warn("cache pin '{}' of tenant '{}' lost its blocks; dropped", pin.name, pin.tenant);
      (void)catalog_->DeletePin(pin.tenant, pin.name);
    }
  }
  // Sessions stay valid without their cached prefix (a turn renders the whole conversation);
  // a session whose recorded entries are gone gets its keys cleared.
  size_t repaired = 0;
  for (const cache::Catalog::SessionKeys& x : catalog_->AllSessionKeys()) {
    const bool head_ok = x.head_key.IsRoot() || store->Contains(x.head_key);
    const bool snap_ok = x.snapshot_key.IsRoot() || store->Contains(x.snapshot_key);
    if (head_ok && snap_ok) continue;
    if (catalog_->ClearSessionKeys(x.tenant, x.id).ok()) ++repaired;
  }
  if (repaired > 0)
    spdlog::warn("{} sessions pointed at evicted cache entries; keys cleared", repaired);
  const cache::BlockStore::Stats st = store->stats();
  spdlog::info("prefix cache {}: {} blocks, {} snapshots, {:.1f} MiB on disk (quota {:.1f} MiB)",
               o.dir, st.blocks, st.snapshots, st.disk_bytes / 1048576.0,
               o.disk_quota_bytes / 1048576.0);
  cache_ = std::shared_ptr<cache::BlockStore>(std::move(store));
  return Status::Ok();
}

void Daemon::Reload() {
  if (config_path_.empty()) {
    spdlog::info("SIGHUP: the daemon runs on built-in defaults; there is no file to read again");
    return;
  }
  if (!load_finished_) {
    // The loader is still setting up the cache and engine; a reload waits for it to finish.
    spdlog::warn("SIGHUP: the model is still loading; send it again once /health is ok");
    return;
  }
  StatusOr<Config> next = LoadConfigFile(config_path_);
  Status s = next.ok() ? ApplyEnvironment(&*next, ProcessEnvironment()) : next.status();
  if (!s.ok()) {
    spdlog::error("SIGHUP: {} not applied, the running configuration stays: {}", config_path_,
                  s.message());
    return;
  }
  const Config& n = *next;
  std::vector<std::string> applied, restart;
  if (n.log.level != applied_.log.level) {
    spdlog::set_level(spdlog::level::from_str(n.log.level));
    applied.push_back("log.level");
  }
  if (n.auth.keys != applied_.auth.keys || n.auth.groups != applied_.auth.groups ||
      n.auth.admins != applied_.auth.admins) {
    api_->ReloadAuth(n.auth);
    applied.push_back("auth");
  }
  const CacheConfig& c = n.cache;
  if (c.disk_quota_bytes != applied_.cache.disk_quota_bytes ||
      c.ttl_seconds != applied_.cache.ttl_seconds || c.ram_bytes != applied_.cache.ram_bytes) {
    if (cache_) cache_->SetLimits(c.ram_bytes, c.disk_quota_bytes, c.ttl_seconds);
    applied.push_back("cache quotas");
  }
  if (c.block_tokens != applied_.cache.block_tokens) restart.push_back("cache.block_tokens");
  if (c.eviction != applied_.cache.eviction) restart.push_back("cache.eviction");
  if (n.model.dir != applied_.model.dir || n.model.id != applied_.model.id)
    restart.push_back("model");
  if (n.state_dir != applied_.state_dir) restart.push_back("state_dir");
  if (n.server.listen_host != applied_.server.listen_host ||
      n.server.listen_port != applied_.server.listen_port ||
      n.server.socket_path != applied_.server.socket_path) {
    restart.push_back("server listeners");
  }
  if (n.engine.memory_budget_bytes != applied_.engine.memory_budget_bytes ||
      n.engine.max_running != applied_.engine.max_running ||
      n.engine.step_token_budget != applied_.engine.step_token_budget ||
      n.engine.threads != applied_.engine.threads || n.engine.backend != applied_.engine.backend ||
      n.engine.gpus != applied_.engine.gpus ||
      n.engine.routed_experts != applied_.engine.routed_experts ||
      n.engine.gpu_gemms != applied_.engine.gpu_gemms ||
      n.engine.speculative != applied_.engine.speculative ||
      n.engine.speculative_tokens != applied_.engine.speculative_tokens) {
    restart.push_back("engine");
  }
  // What was applied becomes the running configuration; the rest keeps its old value.
  applied_.log = n.log;
  applied_.auth = n.auth;
  applied_.cache.disk_quota_bytes = c.disk_quota_bytes;
  applied_.cache.ttl_seconds = c.ttl_seconds;
  applied_.cache.ram_bytes = c.ram_bytes;
  std::string a, r;
  for (const std::string& x : applied) a += (a.empty() ? "" : ", ") + x;
  for (const std::string& x : restart) r += (r.empty() ? "" : ", ") + x;
  spdlog::warn("SIGHUP: reloaded {}: applied {}{}", config_path_, a.empty() ? "nothing new" : a,
               r.empty() ? "" : "; changed but needing a restart: " + r);
  sd_notify(0, "READY=1\nSTATUS=serving; configuration reloaded");
}

void Daemon::WritePidFile() {
  const std::string& path = config_.server.pid_file;
  if (path.empty()) return;
  std::ofstream out(path, std::ios::trunc);
  out << ::getpid() << "\n";
  if (!out) {
    spdlog::warn("{}: cannot write pid file \"{}\"", config_.Where("server.pid_file"), path);
    return;
  }
  own_pid_file_ = true;
}

void Daemon::RemoveFiles() {
  if (own_socket_file_) {
    ::unlink(config_.server.socket_path.c_str());
    own_socket_file_ = false;
  }
  if (own_pid_file_) {
    // Remove the pid file only while it still names this process.
    std::ifstream in(config_.server.pid_file);
    long pid = 0;
    if (in >> pid && pid == ::getpid()) ::unlink(config_.server.pid_file.c_str());
    own_pid_file_ = false;
  }
}

bool Daemon::StopListeners(int grace_seconds) {
  if (threads_.empty()) return true;
  // httplib's stop() closes the listening socket and then joins its workers, so it returns only
  // once every in-flight response has been written. Run it aside and wait at most the grace
  // (a negative grace waits for as long as it takes). The stopper may outlive this call, so
  // what it shares lives on the heap.
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  auto shared = std::make_shared<Shared>();
  std::thread stopper([shared, this] {
    if (tcp_) tcp_->stop();
    if (unix_) unix_->stop();
    for (std::thread& t : threads_) t.join();
    std::lock_guard<std::mutex> lock(shared->mu);
    shared->done = true;
    shared->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(shared->mu);
  const auto is_done = [&] { return shared->done; };
  const bool finished =
      grace_seconds < 0 ? (shared->cv.wait(lock, is_done), true)
                        : shared->cv.wait_for(lock, std::chrono::seconds(grace_seconds), is_done);
  lock.unlock();
  if (!finished) {
    // The process is about to exit without joining the workers that hold the responses.
    stopper.detach();
    return false;
  }
  stopper.join();
  threads_.clear();
  return true;
}

int Daemon::Run() {
  uv_loop_t loop;
  uv_loop_init(&loop);
  uv_signal_t sigterm;
  uv_signal_t sigint;
  uv_signal_t sighup;
  uv_timer_t watchdog;
  int received = 0;

  auto on_signal = [](uv_signal_t* handle, int signum) {
    *static_cast<int*>(handle->data) = signum;
    uv_stop(handle->loop);
  };
  for (auto [handle, signum] : {std::pair{&sigterm, SIGTERM}, std::pair{&sigint, SIGINT}}) {
    uv_signal_init(&loop, handle);
    handle->data = &received;
    uv_signal_start(handle, on_signal, signum);
  }
  uv_signal_init(&loop, &sighup);
  sighup.data = this;
  uv_signal_start(
      &sighup, [](uv_signal_t* h, int) { static_cast<Daemon*>(h->data)->Reload(); }, SIGHUP);

  // Under systemd with WatchdogSec=, ping at half the interval from the loop.
  uint64_t watchdog_usec = 0;
  uv_timer_init(&loop, &watchdog);
  if (sd_watchdog_enabled(0, &watchdog_usec) > 0 && watchdog_usec > 0) {
    uint64_t ms = watchdog_usec / 2000;
    uv_timer_start(
        &watchdog, [](uv_timer_t*) { sd_notify(0, "WATCHDOG=1"); }, ms, ms);
  }

  std::string ready = "flashd ready:";
  if (tcp_) ready += " http://" + listen_host_ + ":" + std::to_string(tcp_port_);
  if (unix_) ready += " unix:" + socket_path_;
  spdlog::info("{} (pid {})", ready, ::getpid());
  // The same line on stdout, for scripts and tests that start the daemon and wait for it.
  std::printf("%s\n", ready.c_str());
  std::fflush(stdout);
  sd_notify(0, "READY=1\nSTATUS=serving");

  uv_run(&loop, UV_RUN_DEFAULT);

  spdlog::info("received {}, shutting down (grace {} s, {} requests in flight)",
               received == SIGTERM ? "SIGTERM" : "SIGINT", config_.server.shutdown_grace_seconds,
               api_->metrics().InFlight());
  sd_notify(0, "STOPPING=1\nSTATUS=draining");
  api_->SetPhase(api::Phase::kStopping, "shutting down");

  uv_signal_stop(&sigterm);
  uv_signal_stop(&sigint);
  uv_signal_stop(&sighup);
  uv_timer_stop(&watchdog);
  for (uv_handle_t* h :
       {reinterpret_cast<uv_handle_t*>(&sigterm), reinterpret_cast<uv_handle_t*>(&sigint),
        reinterpret_cast<uv_handle_t*>(&sighup), reinterpret_cast<uv_handle_t*>(&watchdog)}) {
    uv_close(h, nullptr);
  }
  uv_run(&loop, UV_RUN_DEFAULT);
  uv_loop_close(&loop);

  bool drained = StopListeners(config_.server.shutdown_grace_seconds);
  RemoveFiles();
  if (!load_finished_) {
    // Loading cannot be interrupted midway; nothing it holds needs an orderly release.
    spdlog::info("model loading abandoned by shutdown");
    loader_.detach();
    drained = false;
  } else if (loader_.joinable()) {
    loader_.join();
  }
  if (!drained) {
    if (api_->metrics().InFlight() > 0) {
      spdlog::warn("{} responses did not finish within {} s; closing them",
                   api_->metrics().InFlight(), config_.server.shutdown_grace_seconds);
    }
    spdlog::shutdown();
    std::fflush(stdout);
    // Worker threads still hold the abandoned responses; leave without joining them.
    ::_exit(0);
  }
  spdlog::info("stopped cleanly");
  return 0;
}

}  // namespace flashd::daemon
