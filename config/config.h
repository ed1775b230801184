// The daemon's configuration: one YAML file, validated once into plain structs.
//
// Every key, its type and its range live in config.cc; the commented example is
// config/flashd.yaml. A bad file is reported as one line naming the file, line, key and what was
// expected. Environment overrides (FLASHD_LISTEN, FLASHD_SOCKET, FLASHD_STATE_DIR,
// FLASHD_MODEL_DIR, FLASHD_LOG_LEVEL) are applied after the file, so scripts and tests can move a
// daemon without editing it. Relative paths are taken relative to the working directory.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "config/status.h"

namespace flashd {

struct ServerConfig {
  // TCP listener "host:port"; port 0 picks a free port. Empty disables the TCP listener.
  std::string listen_host = "127.0.0.1";
  int listen_port = 8741;
  bool listen_enabled = true;
  // Unix socket path; empty disables the socket listener.
  std::string socket_path = "./var/run/flashd.sock";
  uint32_t socket_mode = 0660;
  std::string socket_group;  // Empty: keep the daemon's group.
  std::string pid_file = "./var/run/flashd.pid";
  int http_threads = 16;            // Ready workers per listener; more start while all are busy.
  int shutdown_grace_seconds = 10;  // How long in-flight responses may finish on SIGTERM.
  uint64_t max_request_bytes = 64ull << 20;
  int max_messages = 10000;  // Messages (or input items) in one request.
  // Host names (beside localhost, 127.0.0.1 and [::1]) a loopback TCP listener answers to; any
  // other Host header is refused, so a web page cannot reach the daemon through DNS rebinding.
  std::vector<std::string> allowed_hosts;
  // Web origins ("https://app.example.com") allowed to call the API from a browser (CORS). Empty:
  // requests that carry any other Origin header are refused.
  std::vector<std::string> cors_origins;
};

struct ModelConfig {
  std::string dir;  // Empty: the embedded default tiny model (random weights).
  std::string id = "deepseek-v4.1-flash";
  // Tokenizer files for the embedded default model (a model directory brings its own). Empty:
  // the ones installed with the binary (engine::FindDefaultTokenizerDir), wherever it was
  // started from.
  std::string tokenizer_dir;
  // Check every weight file's SHA-256 against SHA256SUMS in the model directory while reading
  // the files at start-up; a file that differs (or has no line there) stops the model loading.
  bool verify = false;
};

struct LogConfig {
  std::string level = "info";  // trace, debug, info, warn, error, off.
};

struct EngineConfig {
  int64_t step_token_budget = 2048;  // Tokens per forward step (decodes and prefill chunks).
  int64_t prefill_chunk = 512;       // Most prompt tokens of one sequence per step.
  int64_t max_running = 64;          // Sequences generating at once.
  uint64_t memory_budget_bytes = 8ull << 30;  // KV and state of admitted sequences.
  int threads = 0;                            // Forward-pass threads; 0: all cores.
  // Where the forward pass runs: auto (a usable GPU, else the CPU), cpu, cuda, hip, or hipcpu
  // (the GPU kernels on the CPU, for checking them).
  std::string backend = "auto";
  // GPUs of that backend to spread the layers over (whole layers in order, split by their bytes
  // as `flashd plan` does); 1 on the CPU.
  int gpus = 1;
  // Where the routed experts run: with their layer, or on the CPU (the hybrid mode of one GPU
  // beside a large host memory).
  std::string routed_experts = "layer";
  // How a GPU backend computes the FP8 and FP4 linears: exact (every block's 32 products summed
  // in the CPU's order) or matrix (on the matrix cores, the fast way to prefill long prompts;
  // each block's sum rounded by the instruction). Either way a prompt gives the same tokens
  // however it is batched or chunked. The CPU ignores it.
  std::string gpu_gemms = "exact";
  // Speculative decoding: dspark (the checkpoint's own draft heads, when it has them) or off.
  // The output is the same either way: greedy token for token, sampled in distribution.
  std::string speculative = "dspark";
  // Drafted tokens verified per step: 0 lets the confidence head and the acceptance so far
  // decide (adaptive), N verifies N every step (for measurement), at most the draft block.
  int speculative_tokens = 0;
  // Where the Engram tables' rows come from: memory (the mapped tables) or ssd (read from the
  // checkpoint's files with io_uring per step, behind a cache of hot rows of
  // engram_cache_bytes), for boxes whose memory does not hold the tables.
  std::string engram = "memory";
  uint64_t engram_cache_bytes = 1ull << 30;
};

struct CacheConfig {
  int block_tokens = 64;
  uint64_t ram_bytes = 4ull << 30;
  uint64_t disk_quota_bytes = 256ull << 30;
  int64_t ttl_seconds = 0;       // 0: blocks never expire by age.
  std::string eviction = "lru";  // lru or cost (cache/block_store.h, StoreOptions::Eviction).
};

struct AuthConfig {
  // Tenant name -> API key. Empty: no keys; every request is the tenant "default", and the TCP
  // listener must be on a loopback address.
  std::map<std::string, std::string> keys;
  // Group name -> member tenants. A member can publish a prefix to its group (a pin with
  // "group"), and every member's requests may start from the group's published prefixes.
  std::map<std::string, std::vector<std::string>> groups;
  // Tenants whose keys may read daemon-wide counters (/metrics, GET /v1/cache). The daemon's own
  // user on the Unix socket always may; without keys, so may every TCP client (one tenant).
  std::vector<std::string> admins;
};

struct Config {
  ServerConfig server;
  std::string state_dir = "./var/state";
  ModelConfig model;
  LogConfig log;
  EngineConfig engine;
  CacheConfig cache;
  AuthConfig auth;

  // Where each dotted key got its value: "FILE:LINE", "environment FLASHD_X", or absent for the
  // built-in default. Used to point later errors (e.g. an unwritable state_dir) at their source.
  std::map<std::string, std::string> origin;

  // "FILE:LINE: key" or "environment FLASHD_X: key" or "key", for error messages.
  std::string Where(const std::string& key) const;
};

// Parses YAML text. `filename` is only used in messages.
StatusOr<Config> ParseConfig(std::string_view yaml_text, std::string_view filename);

// Reads and parses a file.
StatusOr<Config> LoadConfigFile(const std::string& path);

// Looks up an environment variable; returns nullopt when unset.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;
EnvLookup ProcessEnvironment();

// Applies the FLASHD_* overrides in place.
Status ApplyEnvironment(Config* config, const EnvLookup& env);

// Creates the state directory (and the socket's and pid file's parent directories) if needed and
// checks that each is writable. Errors name the key and where its value came from.
Status PrepareDirectories(const Config& config);

// The state dir, its cache dir and its catalog, where they exist with any group or other
// permission bit set (state written before the daemon created its files 0700/0600).
std::vector<std::string> ExposedStateFiles(const Config& config);

// Parsers shared by the file and the environment, exposed for tests.
Status ParseListen(std::string_view text, std::string* host, int* port);
StatusOr<uint64_t> ParseByteSize(std::string_view text);
bool IsValidLogLevel(std::string_view level);

}  // namespace flashd
