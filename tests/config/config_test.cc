#include "config/config.h"

#include <boost/test/unit_test.hpp>
#include <filesystem>
#include <fstream>
#include <map>

namespace flashd {
namespace {

StatusOr<Config> Parse(const std::string& yaml) { return ParseConfig(yaml, "test.yaml"); }

// The message of a config that must fail.
std::string ErrorOf(const std::string& yaml) {
  StatusOr<Config> c = Parse(yaml);
  BOOST_REQUIRE_MESSAGE(!c.ok(), "expected an error for:\n" + yaml);
  return c.status().message();
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

EnvLookup FakeEnv(std::map<std::string, std::string> vars) {
  return [vars](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

BOOST_AUTO_TEST_SUITE(config)

BOOST_AUTO_TEST_CASE(empty_file_gives_defaults) {
  StatusOr<Config> c = Parse("");
  BOOST_REQUIRE(c.ok());
  BOOST_TEST(c->server.listen_host == "127.0.0.1");
  BOOST_TEST(c->server.listen_port == 8741);
  BOOST_TEST(c->server.socket_path == "./var/run/flashd.sock");
  BOOST_TEST(c->server.socket_mode == 0660u);
  BOOST_TEST(c->cache.block_tokens == 64);
  BOOST_TEST(c->model.dir.empty());
}

BOOST_AUTO_TEST_CASE(shipped_config_parses_to_the_defaults) {
  StatusOr<Config> c = LoadConfigFile(FLASHD_SOURCE_DIR "/config/flashd.yaml");
  BOOST_REQUIRE_MESSAGE(c.ok(), c.status().ToString());
  Config d;
  BOOST_TEST(c->server.listen_port == d.server.listen_port);
  BOOST_TEST(c->server.socket_path == d.server.socket_path);
  BOOST_TEST(c->server.socket_mode == d.server.socket_mode);
  BOOST_TEST(c->server.max_request_bytes == d.server.max_request_bytes);
  BOOST_TEST(c->state_dir == d.state_dir);
  BOOST_TEST(c->cache.ram_bytes == d.cache.ram_bytes);
  BOOST_TEST(c->cache.disk_quota_bytes == d.cache.disk_quota_bytes);
  BOOST_TEST(c->Where("server.listen").find("flashd.yaml:") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(values_are_read) {
  StatusOr<Config> c = Parse(
      "server:\n"
      "  listen: \"[::1]:9000\"\n"
      "  socket_mode: \"0600\"\n"
      "  max_request_bytes: 2MiB\n"
      "state_dir: /tmp/x\n"
      "model:\n"
      "  dir: /models/flash\n"
      "cache:\n"
      "  block_tokens: 128\n"
      "  ram_bytes: 1GiB\n"
      "  ttl_seconds: 3600\n"
      "  eviction: lru\n");
  BOOST_REQUIRE_MESSAGE(c.ok(), c.status().ToString());
  BOOST_TEST(c->server.listen_host == "::1");
  BOOST_TEST(c->server.listen_port == 9000);
  BOOST_TEST(c->server.socket_mode == 0600u);
  BOOST_TEST(c->server.max_request_bytes == 2u << 20);
  BOOST_TEST(c->state_dir == "/tmp/x");
  BOOST_TEST(c->model.dir == "/models/flash");
  BOOST_TEST(c->cache.block_tokens == 128);
  BOOST_TEST(c->cache.ram_bytes == 1ull << 30);
  BOOST_TEST(c->cache.ttl_seconds == 3600);
  BOOST_TEST(c->cache.eviction == "lru");
  BOOST_TEST(c->Where("cache.ram_bytes") == "test.yaml:10: cache.ram_bytes");
}

BOOST_AUTO_TEST_CASE(unknown_key_names_line_and_key) {
  std::string m = ErrorOf("server:\n  listen: \"127.0.0.1:1\"\n  lisen: x\n");
  BOOST_TEST(Contains(m, "test.yaml:3"), m);
  BOOST_TEST(Contains(m, "server.lisen"), m);
  BOOST_TEST(Contains(m, "unknown key"), m);
  BOOST_TEST(Contains(m, "listen"), m);  // Lists what is allowed.

  std::string top = ErrorOf("stat_dir: /tmp\n");
  BOOST_TEST(Contains(top, "test.yaml:1: stat_dir: unknown key at the top level"), top);
}

BOOST_AUTO_TEST_CASE(wrong_type_names_key_and_expectation) {
  std::string m = ErrorOf("server:\n  http_threads: many\n");
  BOOST_TEST(Contains(m, "test.yaml:2: server.http_threads: expected an integer"), m);
  BOOST_TEST(Contains(m, "\"many\""), m);

  std::string seq = ErrorOf("model:\n  dir: [a, b]\n");
  BOOST_TEST(Contains(seq, "test.yaml:2: model.dir"), seq);
  BOOST_TEST(Contains(seq, "sequence"), seq);

  std::string section = ErrorOf("server: 5\n");
  BOOST_TEST(Contains(section, "test.yaml:1: server: expected a mapping"), section);
}

BOOST_AUTO_TEST_CASE(out_of_range_values_are_rejected) {
  struct Case {
    std::string yaml;
    std::string key;
  };
  const Case cases[] = {
      {"server:\n  listen: \"127.0.0.1:70000\"\n", "server.listen"},
      {"server:\n  listen: \"localhost\"\n", "server.listen"},
      {"server:\n  http_threads: 0\n", "server.http_threads"},
      {"server:\n  socket_mode: \"0999\"\n", "server.socket_mode"},
      {"server:\n  socket_mode: \"01777\"\n", "server.socket_mode"},
      {"server:\n  shutdown_grace_seconds: -1\n", "server.shutdown_grace_seconds"},
      {"server:\n  max_request_bytes: 12 parsecs\n", "server.max_request_bytes"},
      {"cache:\n  block_tokens: 100\n", "cache.block_tokens"},
      {"cache:\n  block_tokens: 8\n", "cache.block_tokens"},
      {"cache:\n  ttl_seconds: -5\n", "cache.ttl_seconds"},
      {"cache:\n  eviction: fifo\n", "cache.eviction"},
      {"log:\n  level: loud\n", "log.level"},
      {"engine:\n  backend: gpu\n", "engine.backend"},
      {"engine:\n  gpus: 0\n", "engine.gpus"},
      {"engine:\n  routed_experts: gpu\n", "engine.routed_experts"},
      {"engine:\n  gpu_gemms: fast\n", "engine.gpu_gemms"},
      {"model:\n  id: \"\"\n", "model.id"},
      {"state_dir: \"\"\n", "state_dir"},
  };
  for (const Case& c : cases) {
    std::string m = ErrorOf(c.yaml);
    BOOST_TEST((Contains(m, "test.yaml:2: " + c.key) || Contains(m, "test.yaml:1: " + c.key)), m);
    BOOST_TEST(Contains(m, "expected"), m);
  }
}

BOOST_AUTO_TEST_CASE(duplicate_key_is_an_error) {
  std::string m = ErrorOf("log:\n  level: info\n  level: debug\n");
  BOOST_TEST(Contains(m, "test.yaml:3: log.level: key appears twice"), m);
}

BOOST_AUTO_TEST_CASE(yaml_syntax_error_names_line) {
  std::string m = ErrorOf("server:\n  listen: [unclosed\n  socket: x\n");
  BOOST_TEST(Contains(m, "test.yaml:"), m);
  BOOST_TEST(Contains(m, "YAML syntax error"), m);
}

BOOST_AUTO_TEST_CASE(no_listener_at_all_is_an_error) {
  std::string m = ErrorOf("server:\n  listen: \"\"\n  socket: \"\"\n");
  BOOST_TEST(Contains(m, "at least one listener"), m);
}

BOOST_AUTO_TEST_CASE(environment_overrides_the_file) {
  StatusOr<Config> c = Parse(
      "server:\n  listen: \"127.0.0.1:1000\"\nlog:\n  level: warn\nauth:\n  keys:\n"
      "    alice: 0123456789abcdef0123\n");
  BOOST_REQUIRE(c.ok());
  Status s = ApplyEnvironment(&*c, FakeEnv({{"FLASHD_LISTEN", "0.0.0.0:0"},
                                            {"FLASHD_SOCKET", "/tmp/a.sock"},
                                            {"FLASHD_STATE_DIR", "/tmp/st"},
                                            {"FLASHD_MODEL_DIR", "/m"},
                                            {"FLASHD_LOG_LEVEL", "debug"},
                                            {"FLASHD_BACKEND", "cpu"}}));
  BOOST_REQUIRE_MESSAGE(s.ok(), s.ToString());
  BOOST_TEST(c->server.listen_host == "0.0.0.0");
  BOOST_TEST(c->server.listen_port == 0);
  BOOST_TEST(c->server.socket_path == "/tmp/a.sock");
  BOOST_TEST(c->state_dir == "/tmp/st");
  BOOST_TEST(c->model.dir == "/m");
  BOOST_TEST(c->log.level == "debug");
  BOOST_TEST(c->Where("log.level") == "environment FLASHD_LOG_LEVEL: log.level");
  BOOST_TEST(c->engine.backend == "cpu");
  BOOST_TEST(Config().engine.backend == "auto");
}

BOOST_AUTO_TEST_CASE(api_keys_map_tenants) {
  StatusOr<Config> c =
      Parse("auth:\n  keys:\n    alice: alice-key-0123456789\n    bob: bob-key-0123456789ab\n");
  BOOST_REQUIRE_MESSAGE(c.ok(), c.status().ToString());
  BOOST_TEST(c->auth.keys.size() == 2u);
  BOOST_TEST(c->auth.keys.at("bob") == "bob-key-0123456789ab");
  BOOST_TEST(c->Where("auth.keys.bob") == "test.yaml:4: auth.keys.bob");
  std::string shortkey = ErrorOf("auth:\n  keys:\n    alice: short\n");
  BOOST_TEST(Contains(shortkey, "test.yaml:3: auth.keys.alice: expected a key of at least 16"),
             shortkey);
  BOOST_TEST(!Contains(shortkey, "short\""), "the key itself is never shown: " + shortkey);
  std::string same =
      ErrorOf("auth:\n  keys:\n    a: 0123456789abcdef0\n    b: 0123456789abcdef0\n");
  BOOST_TEST(Contains(same, "auth.keys.b: the same key is given to two tenants"), same);
  std::string bad_tenant = ErrorOf("auth:\n  keys:\n    \"a b\": 0123456789abcdef0\n");
  BOOST_TEST(Contains(bad_tenant, "tenant name"), bad_tenant);
  std::string unknown = ErrorOf("auth:\n  users: 1\n");
  BOOST_TEST(Contains(unknown, "expected one of: admins, groups, keys"), unknown);
}

BOOST_AUTO_TEST_CASE(groups_list_their_tenants) {
  StatusOr<Config> c = Parse("auth:\n  groups:\n    team: [alice, bob]\n");
  BOOST_REQUIRE_MESSAGE(c.ok(), c.status().ToString());
  BOOST_TEST((c->auth.groups.at("team") == std::vector<std::string>{"alice", "bob"}));
  std::string m = ErrorOf("auth:\n  groups:\n    team: alice\n");
  BOOST_TEST(Contains(m, "test.yaml:3: auth.groups.team: expected a list of tenants"), m);
}

BOOST_AUTO_TEST_CASE(browser_and_admin_lists_are_read_and_checked) {
  StatusOr<Config> c = Parse(
      "server:\n  allowed_hosts: [box.lan]\n  cors_origins: [\"https://ide.example\"]\n"
      "auth:\n  keys:\n    ops: 0123456789abcdef0\n  admins: [ops]\n");
  BOOST_REQUIRE_MESSAGE(c.ok(), c.status().ToString());
  BOOST_TEST((c->server.allowed_hosts == std::vector<std::string>{"box.lan"}));
  BOOST_TEST((c->server.cors_origins == std::vector<std::string>{"https://ide.example"}));
  BOOST_TEST((c->auth.admins == std::vector<std::string>{"ops"}));
  std::string m = ErrorOf("server:\n  allowed_hosts: [\"box.lan:8741\"]\n");
  BOOST_TEST(Contains(m, "test.yaml:2: server.allowed_hosts: \"box.lan:8741\": expected a host"),
             m);
  m = ErrorOf("server:\n  cors_origins: [ide.example]\n");
  BOOST_TEST(Contains(m, "test.yaml:2: server.cors_origins: \"ide.example\": expected an origin"),
             m);
  m = ErrorOf("auth:\n  admins: [ops]\n");
  BOOST_TEST(Contains(m, "test.yaml:2: auth.admins: \"ops\" is not a tenant of auth.keys"), m);
  m = ErrorOf("server:\n  allowed_hosts: box.lan\n");
  BOOST_TEST(Contains(m, "test.yaml:2: server.allowed_hosts: expected a list"), m);
}

BOOST_AUTO_TEST_CASE(a_public_address_needs_api_keys) {
  StatusOr<Config> c = Parse("server:\n  listen: \"0.0.0.0:8741\"\n");
  BOOST_REQUIRE(c.ok());
  Status s = ApplyEnvironment(&*c, FakeEnv({}));
  BOOST_TEST(Contains(s.message(), "test.yaml:2: server.listen: \"0.0.0.0\" is not a loopback"),
             s.message());
  StatusOr<Config> keyed =
      Parse("server:\n  listen: \"0.0.0.0:8741\"\nauth:\n  keys:\n    t: 0123456789abcdef0\n");
  BOOST_REQUIRE(keyed.ok());
  BOOST_TEST(ApplyEnvironment(&*keyed, FakeEnv({})).ok());
  StatusOr<Config> local = Parse("server:\n  listen: \"127.0.0.2:8741\"\n");
  BOOST_TEST(ApplyEnvironment(&*local, FakeEnv({})).ok());
}

BOOST_AUTO_TEST_CASE(bad_environment_value_names_the_variable) {
  Config c;
  Status s = ApplyEnvironment(&c, FakeEnv({{"FLASHD_LISTEN", "nohost"}}));
  BOOST_TEST(!s.ok());
  BOOST_TEST(Contains(s.message(), "environment FLASHD_LISTEN: server.listen"), s.message());
  Status level = ApplyEnvironment(&c, FakeEnv({{"FLASHD_LOG_LEVEL", "chatty"}}));
  BOOST_TEST(Contains(level.message(), "FLASHD_LOG_LEVEL"), level.message());
  Status backend = ApplyEnvironment(&c, FakeEnv({{"FLASHD_BACKEND", "tpu"}}));
  BOOST_TEST(Contains(backend.message(), "FLASHD_BACKEND: engine.backend: expected one of auto"),
             backend.message());
}

BOOST_AUTO_TEST_CASE(byte_sizes) {
  BOOST_TEST(*ParseByteSize("0") == 0u);
  BOOST_TEST(*ParseByteSize("1536") == 1536u);
  BOOST_TEST(*ParseByteSize("4KiB") == 4096u);
  BOOST_TEST(*ParseByteSize("3 GiB") == 3ull << 30);
  BOOST_TEST(*ParseByteSize("2T") == 2ull << 40);
  BOOST_TEST(!ParseByteSize("GiB").ok());
  BOOST_TEST(!ParseByteSize("5 furlongs").ok());
  BOOST_TEST(!ParseByteSize("99999999999999999999").ok());
  BOOST_TEST(!ParseByteSize("17000000TiB").ok());
}

BOOST_AUTO_TEST_CASE(unwritable_state_dir_names_key_and_origin) {
  namespace fs = std::filesystem;
  fs::path tmp = fs::temp_directory_path() / ("flashd-config-test-" + std::to_string(getpid()));
  fs::create_directories(tmp);
  // A regular file where a directory should be: no user, root included, can create under it.
  std::ofstream(tmp / "blocker") << "x";
  StatusOr<Config> c = Parse("state_dir: " + (tmp / "blocker" / "state").string() +
                             "\nserver:\n  socket: \"\"\n  pid_file: \"\"\n");
  BOOST_REQUIRE(c.ok());
  Status s = PrepareDirectories(*c);
  BOOST_TEST(!s.ok());
  BOOST_TEST(Contains(s.message(), "test.yaml:1: state_dir"), s.message());

  StatusOr<Config> good = Parse("state_dir: " + (tmp / "state").string() + "\nserver:\n  socket: " +
                                (tmp / "run" / "s.sock").string() + "\n  pid_file: \"\"\n");
  BOOST_REQUIRE(good.ok());
  BOOST_TEST(PrepareDirectories(*good).ok());
  BOOST_TEST(fs::is_directory(tmp / "state"));
  BOOST_TEST(fs::is_directory(tmp / "run"));
  fs::remove_all(tmp);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd
