#include "config/config.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <vector>

namespace flashd {
namespace {

// One leaf key of the schema: its dotted name and how a scalar becomes a field of Config.
struct Field {
  const char* key;
  const char* expected;  // What a person should write, for messages.
  std::function<Status(const std::string& text, Config* config)> apply;
};

StatusOr<int64_t> ParseInteger(std::string_view text, int64_t lo, int64_t hi) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || ptr != end || text.empty()) {
    return InvalidArgument("not an integer");
  }
  if (value < lo || value > hi) {
    return InvalidArgument("out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return value;
}

Status SetInt(const std::string& text, int64_t lo, int64_t hi, int* out) {
  FLASHD_ASSIGN_OR_RETURN(int64_t v, ParseInteger(text, lo, hi));
  *out = static_cast<int>(v);
  return Status::Ok();
}

Status SetByteSize(const std::string& text, uint64_t* out) {
  FLASHD_ASSIGN_OR_RETURN(*out, ParseByteSize(text));
  return Status::Ok();
}

Status SetNonEmpty(const std::string& text, std::string* out) {
  if (text.empty()) return InvalidArgument("must not be empty");
  *out = text;
  return Status::Ok();
}

const std::vector<Field>& Schema() {
  static const std::vector<Field> fields = {
      {"server.listen", "\"host:port\" (port 0-65535), or \"\" to disable TCP",
       [](const std::string& t, Config* c) {
         if (t.empty()) {
           c->server.listen_enabled = false;
           return Status::Ok();
         }
         c->server.listen_enabled = true;
         return ParseListen(t, &c->server.listen_host, &c->server.listen_port);
       }},
      {"server.socket", "a filesystem path, or \"\" to disable the Unix socket",
       [](const std::string& t, Config* c) {
         if (t.size() >= 108) return InvalidArgument("path longer than 107 bytes");
         c->server.socket_path = t;
         return Status::Ok();
       }},
      {"server.socket_mode", "an octal file mode such as \"0660\"",
       [](const std::string& t, Config* c) {
         uint32_t mode = 0;
         auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), mode, 8);
         if (t.empty() || ec != std::errc() || ptr != t.data() + t.size() || mode > 0777) {
           return InvalidArgument("not an octal mode between 0000 and 0777");
         }
         c->server.socket_mode = mode;
         return Status::Ok();
       }},
      {"server.socket_group", "a group name, or \"\" to keep the daemon's group",
       [](const std::string& t, Config* c) {
         c->server.socket_group = t;
         return Status::Ok();
       }},
      {"server.pid_file", "a filesystem path, or \"\" for none",
       [](const std::string& t, Config* c) {
         c->server.pid_file = t;
         return Status::Ok();
       }},
      {"server.http_threads", "an integer in [1, 1024]",
       [](const std::string& t, Config* c) { return SetInt(t, 1, 1024, &c->server.http_threads); }},
      {"server.shutdown_grace_seconds", "an integer in [0, 3600]",
       [](const std::string& t, Config* c) {
         return SetInt(t, 0, 3600, &c->server.shutdown_grace_seconds);
       }},
      {"server.max_messages", "an integer in [1, 1000000]",
       [](const std::string& t, Config* c) {
         return SetInt(t, 1, 1000000, &c->server.max_messages);
       }},
      {"server.max_request_bytes", "a size such as 67108864 or \"64MiB\" (at least 1KiB)",
       [](const std::string& t, Config* c) {
         FLASHD_ASSIGN_OR_RETURN(uint64_t v, ParseByteSize(t));
         if (v < 1024) return InvalidArgument("below 1KiB");
         c->server.max_request_bytes = v;
         return Status::Ok();
       }},
      {"state_dir", "a directory path",
       [](const std::string& t, Config* c) { return SetNonEmpty(t, &c->state_dir); }},
      {"model.dir", "a model directory path, or \"\" for the embedded default model",
       [](const std::string& t, Config* c) {
         c->model.dir = t;
         return Status::Ok();
       }},
      {"model.tokenizer_dir",
       "a directory holding tokenizer.json, or \"\" for the one installed with flashd",
       [](const std::string& t, Config* c) {
         c->model.tokenizer_dir = t;
         return Status::Ok();
       }},
      {"model.verify", "true or false",
       [](const std::string& t, Config* c) {
         if (t != "true" && t != "false") return InvalidArgument("not true or false");
         c->model.verify = t == "true";
         return Status::Ok();
       }},
      {"model.id", "a non-empty model name",
       [](const std::string& t, Config* c) { return SetNonEmpty(t, &c->model.id); }},
      {"log.level", "one of trace, debug, info, warn, error, off",
       [](const std::string& t, Config* c) {
         if (!IsValidLogLevel(t)) return InvalidArgument("unknown level");
         c->log.level = t;
         return Status::Ok();
       }},
      {"engine.step_token_budget", "an integer in [1, 1048576]",
       [](const std::string& t, Config* c) {
         FLASHD_ASSIGN_OR_RETURN(c->engine.step_token_budget, ParseInteger(t, 1, 1 << 20));
         return Status::Ok();
       }},
      {"engine.prefill_chunk", "an integer in [1, 1048576]",
       [](const std::string& t, Config* c) {
         FLASHD_ASSIGN_OR_RETURN(c->engine.prefill_chunk, ParseInteger(t, 1, 1 << 20));
         return Status::Ok();
       }},
      {"engine.max_running", "an integer in [1, 100000]",
       [](const std::string& t, Config* c) {
         FLASHD_ASSIGN_OR_RETURN(c->engine.max_running, ParseInteger(t, 1, 100000));
         return Status::Ok();
       }},
      {"engine.memory_budget_bytes", "a size such as \"8GiB\"",
       [](const std::string& t, Config* c) {
         return SetByteSize(t, &c->engine.memory_budget_bytes);
       }},
      {"engine.threads", "an integer in [0, 1024] (0: all cores)",
       [](const std::string& t, Config* c) { return SetInt(t, 0, 1024, &c->engine.threads); }},
      {"engine.gpus", "an integer in [1, 64]",
       [](const std::string& t, Config* c) { return SetInt(t, 1, 64, &c->engine.gpus); }},
      {"engine.routed_experts", "layer or cpu",
       [](const std::string& t, Config* c) {
         if (t != "layer" && t != "cpu") return InvalidArgument("not a place");
         c->engine.routed_experts = t;
         return Status::Ok();
       }},
      {"engine.gpu_gemms", "exact or matrix",
       [](const std::string& t, Config* c) {
         if (t != "exact" && t != "matrix") return InvalidArgument("not a GEMM kind");
         c->engine.gpu_gemms = t;
         return Status::Ok();
       }},
      {"engine.speculative", "dspark or off",
       [](const std::string& t, Config* c) {
         if (t != "dspark" && t != "off") return InvalidArgument("not a speculative mode");
         c->engine.speculative = t;
         return Status::Ok();
       }},
      {"engine.engram", "memory or ssd",
       [](const std::string& t, Config* c) {
         if (t != "memory" && t != "ssd") return InvalidArgument("not memory or ssd");
         c->engine.engram = t;
         return Status::Ok();
       }},
      {"engine.engram_cache_bytes", "a size such as \"1GiB\"",
       [](const std::string& t, Config* c) {
         return SetByteSize(t, &c->engine.engram_cache_bytes);
       }},
      {"engine.speculative_tokens", "an integer in [0, 64] (0: adaptive)",
       [](const std::string& t, Config* c) {
         return SetInt(t, 0, 64, &c->engine.speculative_tokens);
       }},
      {"engine.backend", "one of auto, cpu, cuda, hip, hipcpu",
       [](const std::string& t, Config* c) {
         if (t != "auto" && t != "cpu" && t != "cuda" && t != "hip" && t != "hipcpu") {
           return InvalidArgument("not a backend");
         }
         c->engine.backend = t;
         return Status::Ok();
       }},
      {"cache.block_tokens", "a power of two in [16, 4096]",
       [](const std::string& t, Config* c) {
         FLASHD_RETURN_IF_ERROR(SetInt(t, 16, 4096, &c->cache.block_tokens));
         int v = c->cache.block_tokens;
         if ((v & (v - 1)) != 0) return InvalidArgument("not a power of two");
         return Status::Ok();
       }},
      {"cache.ram_bytes", "a size such as 4294967296 or \"4GiB\"",
       [](const std::string& t, Config* c) { return SetByteSize(t, &c->cache.ram_bytes); }},
      {"cache.disk_quota_bytes", "a size such as \"256GiB\"",
       [](const std::string& t, Config* c) { return SetByteSize(t, &c->cache.disk_quota_bytes); }},
      {"cache.ttl_seconds", "an integer number of seconds >= 0 (0: no expiry)",
       [](const std::string& t, Config* c) {
         FLASHD_ASSIGN_OR_RETURN(c->cache.ttl_seconds,
                                 ParseInteger(t, 0, std::numeric_limits<int64_t>::max()));
         return Status::Ok();
       }},
      {"cache.eviction", "lru or cost",
       [](const std::string& t, Config* c) {
         if (t != "cost" && t != "lru") return InvalidArgument("expected cost or lru");
         c->cache.eviction = t;
         return Status::Ok();
       }},
  };
  return fields;
}

const std::set<std::string>& Sections() {
  static const std::set<std::string> sections = {"server", "model", "log",
                                                 "engine", "cache", "auth"};
  return sections;
}

// Keys whose values are mappings or lists, walked by their own functions.
constexpr const char* kListKeys[] = {"auth.keys", "auth.groups", "auth.admins",
                                     "server.allowed_hosts", "server.cors_origins"};

const Field* FindField(const std::string& key) {
  for (const Field& f : Schema()) {
    if (key == f.key) return &f;
  }
  return nullptr;
}

// The keys allowed directly under `prefix` ("" for the top level), for "unknown key" messages.
std::string KnownKeysUnder(const std::string& prefix) {
  std::set<std::string> names;
  auto take = [&](const std::string& dotted) {
    if (dotted.compare(0, prefix.size(), prefix) != 0) return;
    std::string rest = dotted.substr(prefix.size());
    names.insert(rest.substr(0, rest.find('.')));
  };
  for (const Field& f : Schema()) take(f.key);
  for (const char* k : kListKeys) take(k);
  if (prefix.empty()) {
    for (const std::string& s : Sections()) take(s);
  }
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

struct Walker {
  std::string filename;
  Config* config;

  std::string At(const YAML::Node& node) const {
    return filename + ":" + std::to_string(node.Mark().line + 1);
  }

  Status Error(const YAML::Node& node, const std::string& key, const std::string& what) const {
    return InvalidArgument(At(node) + ": " + key + ": " + what);
  }

  // auth.keys: a mapping of tenant names to API keys.
  Status WalkKeys(const YAML::Node& at, const YAML::Node& value) {
    if (value.IsNull()) return Status::Ok();
    if (!value.IsMap()) return Error(at, "auth.keys", "expected a mapping of tenant: key");
    std::set<std::string> seen_keys;
    for (const auto& kv : value) {
      if (!kv.first.IsScalar() || !kv.second.IsScalar()) {
        return Error(kv.first, "auth.keys", "expected tenant: key, both plain strings");
      }
      const std::string tenant = kv.first.Scalar(), key = kv.second.Scalar();
      const std::string where = "auth.keys." + tenant;
      if (tenant.empty() || tenant.size() > 64 ||
          tenant.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                   "0123456789-_.") != std::string::npos) {
        return Error(kv.first, where, "a tenant name is 1-64 letters, digits, '-', '_' or '.'");
      }
      if (tenant == "default" || tenant == "local" || tenant.rfind("uid-", 0) == 0) {
        return Error(kv.first, where,
                     "\"default\", \"local\" and \"uid-...\" are the daemon's own tenant names");
      }
      if (config->auth.keys.count(tenant)) return Error(kv.first, where, "tenant appears twice");
      if (key.size() < 16) {
        return Error(kv.first, where,
                     "expected a key of at least 16 characters (the value is not shown)");
      }
      if (!seen_keys.insert(key).second) {
        return Error(kv.first, where, "the same key is given to two tenants");
      }
      config->auth.keys[tenant] = key;
      config->origin[where] = At(kv.first);
    }
    config->origin["auth.keys"] = At(at);
    return Status::Ok();
  }

  // auth.groups: a mapping of group names to lists of tenants.
  Status WalkGroups(const YAML::Node& at, const YAML::Node& value) {
    if (value.IsNull()) return Status::Ok();
    if (!value.IsMap()) return Error(at, "auth.groups", "expected a mapping of group: [tenants]");
    for (const auto& kv : value) {
      const std::string group = kv.first.IsScalar() ? kv.first.Scalar() : "";
      const std::string where = "auth.groups." + group;
      if (group.empty() || group.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRS"
                                                   "TUVWXYZ0123456789-_.") != std::string::npos) {
        return Error(kv.first, where, "a group name is letters, digits, '-', '_' or '.'");
      }
      if (!kv.second.IsSequence()) return Error(kv.first, where, "expected a list of tenants");
      std::vector<std::string> members;
      for (const auto& m : kv.second) {
        if (!m.IsScalar() || m.Scalar().empty()) {
          return Error(kv.first, where, "expected a list of tenant names");
        }
        members.push_back(m.Scalar());
      }
      config->auth.groups[group] = members;
      config->origin[where] = At(kv.first);
    }
    return Status::Ok();
  }

  // A list of non-empty strings, each accepted by `valid` (which says what it expects).
  Status WalkStrings(const YAML::Node& at, const YAML::Node& value, const std::string& key,
                     const std::function<std::string(const std::string&)>& valid,
                     std::vector<std::string>* out) {
    out->clear();
    if (value.IsNull()) return Status::Ok();
    if (!value.IsSequence()) return Error(at, key, "expected a list");
    for (const auto& item : value) {
      if (!item.IsScalar() || item.Scalar().empty()) {
        return Error(item, key, "expected a list of non-empty strings");
      }
      if (std::string why = valid(item.Scalar()); !why.empty()) {
        return Error(item, key, "\"" + item.Scalar() + "\": " + why);
      }
      out->push_back(item.Scalar());
    }
    config->origin[key] = At(at);
    return Status::Ok();
  }

  Status WalkLists(const YAML::Node& at, const YAML::Node& value, const std::string& key) {
    if (key == "server.allowed_hosts") {
      return WalkStrings(
          at, value, key,
          [](const std::string& h) -> std::string {
            return h.find_first_of(" /:@") == std::string::npos
                       ? ""
                       : "expected a host name without port, scheme or path";
          },
          &config->server.allowed_hosts);
    }
    if (key == "server.cors_origins") {
      return WalkStrings(
          at, value, key,
          [](const std::string& o) -> std::string {
            const bool scheme = o.rfind("http://", 0) == 0 || o.rfind("https://", 0) == 0 ||
                                o.find("://") != std::string::npos;
            return scheme && o.back() != '/' ? ""
                                             : "expected an origin such as https://app.example.com";
          },
          &config->server.cors_origins);
    }
    return WalkStrings(
        at, value, key, [](const std::string&) { return std::string(); }, &config->auth.admins);
  }

  Status WalkMap(const YAML::Node& map, const std::string& prefix) {
    std::set<std::string> seen;
    for (const auto& kv : map) {
      if (!kv.first.IsScalar()) {
        return Error(kv.first, prefix.empty() ? "(top level)" : prefix.substr(0, prefix.size() - 1),
                     "expected a plain key");
      }
      const std::string name = kv.first.Scalar();
      const std::string key = prefix + name;
      if (!seen.insert(name).second) return Error(kv.first, key, "key appears twice");
      const YAML::Node& value = kv.second;
      if (Sections().count(key)) {
        if (value.IsNull()) continue;
        if (!value.IsMap()) return Error(kv.first, key, "expected a mapping of keys");
        FLASHD_RETURN_IF_ERROR(WalkMap(value, key + "."));
        continue;
      }
      if (key == "auth.keys") {
        FLASHD_RETURN_IF_ERROR(WalkKeys(kv.first, value));
        continue;
      }
      if (key == "auth.groups") {
        FLASHD_RETURN_IF_ERROR(WalkGroups(kv.first, value));
        continue;
      }
      if (key == "auth.admins" || key == "server.allowed_hosts" || key == "server.cors_origins") {
        FLASHD_RETURN_IF_ERROR(WalkLists(kv.first, value, key));
        continue;
      }
      const Field* field = FindField(key);
      if (field == nullptr) {
        std::string where =
            prefix.empty() ? "at the top level" : "under " + prefix.substr(0, prefix.size() - 1);
        return Error(kv.first, key,
                     "unknown key " + where + " (expected one of: " + KnownKeysUnder(prefix) + ")");
      }
      if (!value.IsScalar() && !value.IsNull()) {
        return Error(kv.first, key,
                     std::string("expected ") + field->expected + ", got a " +
                         (value.IsMap() ? "mapping" : "sequence"));
      }
      const std::string text = value.IsNull() ? std::string() : value.Scalar();
      Status s = field->apply(text, config);
      if (!s.ok()) {
        return Error(kv.first, key,
                     std::string("expected ") + field->expected + ", got \"" + text + "\" (" +
                         s.message() + ")");
      }
      config->origin[key] = At(kv.first);
    }
    return Status::Ok();
  }
};

}  // namespace

std::string Config::Where(const std::string& key) const {
  auto it = origin.find(key);
  if (it == origin.end()) return key + " (default)";
  return it->second + ": " + key;
}

Status ParseListen(std::string_view text, std::string* host, int* port) {
  std::string_view h;
  std::string_view p;
  if (!text.empty() && text.front() == '[') {
    size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return InvalidArgument("expected [ipv6]:port");
    }
    h = text.substr(1, close - 1);
    p = text.substr(close + 2);
  } else {
    size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) return InvalidArgument("missing ':port'");
    h = text.substr(0, colon);
    p = text.substr(colon + 1);
    if (h.find(':') != std::string_view::npos) {
      return InvalidArgument("write IPv6 hosts as [addr]:port");
    }
  }
  if (h.empty()) return InvalidArgument("missing host");
  auto v = ParseInteger(p, 0, 65535);
  if (!v.ok()) return InvalidArgument("port " + v.status().message());
  *host = std::string(h);
  *port = static_cast<int>(*v);
  return Status::Ok();
}

StatusOr<uint64_t> ParseByteSize(std::string_view text) {
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  if (digits == 0) return InvalidArgument("expected a number of bytes");
  uint64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + digits, value);
  if (ec != std::errc()) return InvalidArgument("number too large");
  std::string_view unit = text.substr(digits);
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  static const std::pair<const char*, int> kUnits[] = {
      {"", 0},     {"B", 0},  {"KiB", 10}, {"MiB", 20}, {"GiB", 30},
      {"TiB", 40}, {"K", 10}, {"M", 20},   {"G", 30},   {"T", 40}};
  for (const auto& [name, shift] : kUnits) {
    if (unit == name) {
      if (shift > 0 && value > (std::numeric_limits<uint64_t>::max() >> shift)) {
        return InvalidArgument("size too large");
      }
      return value << shift;
    }
  }
  return InvalidArgument("unknown unit \"" + std::string(unit) + "\" (use B, KiB, MiB, GiB, TiB)");
}

bool IsValidLogLevel(std::string_view level) {
  for (const char* l : {"trace", "debug", "info", "warn", "error", "off"}) {
    if (level == l) return true;
  }
  return false;
}

StatusOr<Config> ParseConfig(std::string_view yaml_text, std::string_view filename) {
  Config config;
  const std::string file(filename);
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::Exception& e) {
    return InvalidArgument(file + ":" + std::to_string(e.mark.line + 1) +
                           ": YAML syntax error: " + e.msg);
  }
  if (root.IsNull()) return config;  // An empty file means all defaults.
  if (!root.IsMap()) {
    return InvalidArgument(file + ":" + std::to_string(root.Mark().line + 1) +
                           ": expected a mapping of keys at the top level");
  }
  Walker walker{file, &config};
  try {
    FLASHD_RETURN_IF_ERROR(walker.WalkMap(root, ""));
  } catch (const YAML::Exception& e) {
    return InvalidArgument(file + ":" + std::to_string(e.mark.line + 1) + ": " + e.msg);
  }
  if (!config.server.listen_enabled && config.server.socket_path.empty()) {
    return InvalidArgument(file +
                           ": server.listen and server.socket are both empty: at least one "
                           "listener is required");
  }
  for (const std::string& admin : config.auth.admins) {
    if (!config.auth.keys.count(admin)) {
      return InvalidArgument(config.Where("auth.admins") + ": \"" + admin +
                             "\" is not a tenant of auth.keys");
    }
  }
  return config;
}

StatusOr<Config> LoadConfigFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return NotFound(path + ": cannot open config file: " + std::strerror(errno));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseConfig(buffer.str(), path);
}

EnvLookup ProcessEnvironment() {
  return [](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

Status ApplyEnvironment(Config* config, const EnvLookup& env) {
  static const std::pair<const char*, const char*> kOverrides[] = {
      {"FLASHD_LISTEN", "server.listen"}, {"FLASHD_SOCKET", "server.socket"},
      {"FLASHD_STATE_DIR", "state_dir"},  {"FLASHD_MODEL_DIR", "model.dir"},
      {"FLASHD_LOG_LEVEL", "log.level"},  {"FLASHD_BACKEND", "engine.backend"},
  };
  for (const auto& [var, key] : kOverrides) {
    std::optional<std::string> value = env(var);
    if (!value) continue;
    const Field* field = FindField(key);
    Status s = field->apply(*value, config);
    if (!s.ok()) {
      return InvalidArgument(std::string("environment ") + var + ": " + key + ": expected " +
                             field->expected + ", got \"" + *value + "\" (" + s.message() + ")");
    }
    config->origin[key] = std::string("environment ") + var;
  }
  if (!config->server.listen_enabled && config->server.socket_path.empty()) {
    return InvalidArgument(
        "server.listen and server.socket are both empty: at least one listener "
        "is required");
  }
  // Anyone who can reach a non-loopback address could use the model and read the cache.
  const std::string& host = config->server.listen_host;
  const bool loopback =
      host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
  if (config->server.listen_enabled && !loopback && config->auth.keys.empty()) {
    return InvalidArgument(config->Where("server.listen") + ": \"" + host +
                           "\" is not a loopback address; serving it needs API keys in auth.keys");
  }
  return Status::Ok();
}

std::vector<std::string> ExposedStateFiles(const Config& config) {
  std::vector<std::string> out;
  const std::filesystem::path state(config.state_dir);
  for (const std::filesystem::path& p : {state, state / "cache", state / "catalog.db"}) {
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0 && (st.st_mode & 0077) != 0) out.push_back(p.string());
  }
  return out;
}

namespace {

Status EnsureWritableDir(const std::filesystem::path& dir, const Config& config,
                         const std::string& key) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return InvalidArgument(config.Where(key) + ": cannot create directory \"" + dir.string() +
                           "\": " + ec.message());
  }
  if (!std::filesystem::is_directory(dir, ec)) {
    return InvalidArgument(config.Where(key) + ": \"" + dir.string() + "\" is not a directory");
  }
  // access(2) says yes to root everywhere; a real probe file tells the truth (read-only mounts).
  std::filesystem::path probe = dir / (".flashd-write-probe-" + std::to_string(getpid()));
  int fd = ::open(probe.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return InvalidArgument(config.Where(key) + ": directory \"" + dir.string() +
                           "\" is not writable: " + std::strerror(errno));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return Status::Ok();
}

}  // namespace

Status PrepareDirectories(const Config& config) {
  // The state dir holds every tenant's conversations and cached prompts: only the daemon's user
  // may enter one it creates.
  const bool state_existed = std::filesystem::exists(config.state_dir);
  FLASHD_RETURN_IF_ERROR(EnsureWritableDir(config.state_dir, config, "state_dir"));
  if (!state_existed) ::chmod(config.state_dir.c_str(), 0700);
  if (!config.server.socket_path.empty()) {
    std::filesystem::path parent = std::filesystem::path(config.server.socket_path).parent_path();
    if (!parent.empty()) FLASHD_RETURN_IF_ERROR(EnsureWritableDir(parent, config, "server.socket"));
  }
  if (!config.server.pid_file.empty()) {
    std::filesystem::path parent = std::filesystem::path(config.server.pid_file).parent_path();
    if (!parent.empty()) {
      FLASHD_RETURN_IF_ERROR(EnsureWritableDir(parent, config, "server.pid_file"));
    }
  }
  return Status::Ok();
}

}  // namespace flashd
