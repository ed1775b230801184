// End-to-end: the prefix cache across daemon restarts and kill -9, against the real binary on the
// shared tiny model. Every restored answer must equal, bit for bit, the answer of a daemon that
// never saw the prompt before.
#include <httplib.h>
#include <rocksdb/db.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/test/unit_test.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <thread>

#include "tests/e2e/daemon_process.h"
#include "tests/e2e/exact_answers.h"

namespace flashd::testing {
namespace {
using nlohmann::json;
using namespace std::chrono_literals;

std::unique_ptr<httplib::Client> Client(const DaemonProcess& d) { return TcpClient(d, 300); }

BOOST_AUTO_TEST_SUITE(cache_e2e)

BOOST_AUTO_TEST_CASE(a_restarted_daemon_resumes_exactly) {
  const std::vector<int> first = Ids(700, 1);
  const std::vector<int> second = Concat(first, Ids(40, 2));
  TempDir tmp;
  {
    DaemonProcess d({tmp.path(), "", {}, {}});
    BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
    const Answer a = Ask(*Client(d), first);
    BOOST_REQUIRE_MESSAGE(a.status == 200, a.raw);
    BOOST_TEST(a.cached == 0);
    BOOST_TEST(d.Stop(SIGTERM) == 0);
  }
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto c = Client(d);
  // Run once per backend (FLASHD_BACKEND, see tests/CMakeLists.txt): the daemon is on it.
  if (const char* backend = std::getenv("FLASHD_BACKEND")) {
    auto health = c->Get("/health");
    BOOST_REQUIRE(health);
    BOOST_TEST(json::parse(health->body)["backend"]["name"] == backend, health->body);
  }
  BOOST_TEST(Metric(*c, "flashd_prefix_cache_snapshots") >= 1);
  const Answer resumed = Ask(*c, second);
  BOOST_TEST(resumed.cached == 700);  // The first prompt's end state, nothing recomputed.
  BOOST_TEST(Same(resumed, Fresh(second)), resumed.raw);
  if (std::getenv("FLASHD_BACKEND") != nullptr) {
    // The steps ran on that backend: /health counts its traffic and waits.
    const json backend = json::parse(c->Get("/health")->body)["backend"];
    BOOST_TEST(backend["bytes_to_device"].get<uint64_t>() > 0u, backend.dump());
    BOOST_TEST(backend["bytes_to_host"].get<uint64_t>() > 0u, backend.dump());
    BOOST_TEST(backend["host_waits"].get<uint64_t>() > 0u, backend.dump());
    BOOST_TEST(backend["copies_to_host"].get<uint64_t>() > 0u, backend.dump());
    // Every op launches a kernel at least.
    BOOST_TEST(backend["device_ops"].get<uint64_t>() > 0u, backend.dump());
    BOOST_TEST(backend["kernel_launches"].get<uint64_t>() >= backend["device_ops"].get<uint64_t>(),
               backend.dump());
    // Kernels start early only where the device's code waits for the kernels ahead (NVIDIA's),
    // never through the HIP CPU runtime.
    BOOST_TEST(backend["early_launch"].is_boolean(), backend.dump());
    if (std::string(std::getenv("FLASHD_BACKEND")) == "hipcpu") {
      BOOST_TEST(backend["early_launch"] == false, backend.dump());
    }
  }
  BOOST_TEST(Metric(*c, "flashd_prefix_cache_hit_tokens_total") == 700);
  BOOST_TEST(Metric(*c, "flashd_prefix_cache_snapshot_hits_total") == 1);
  BOOST_TEST(Metric(*c, "flashd_prefix_cache_corruptions_total") == 0);
  // flashctl reads the same counters.
  const CommandResult stats =
      RunCommand(SourceDir() + "/clients/flashctl --url " +
                 "http://127.0.0.1:" + std::to_string(d.port()) + " --json cache stats 2>&1");
  BOOST_TEST(stats.code == 0, stats.out);
  const json counters = json::parse(stats.out, nullptr, false);
  BOOST_TEST(counters["hit_tokens"] == 700, stats.out);
  BOOST_TEST(counters["scope"] == "daemon", stats.out);
}

json Get(httplib::Client& c, const std::string& path) {
  auto r = c.Get(path);
  BOOST_REQUIRE(r);
  BOOST_REQUIRE_MESSAGE(r->status == 200, r->body);
  return json::parse(r->body);
}

json Post(httplib::Client& c, const std::string& path, const json& body, int want) {
  auto r = c.Post(path, body.dump(), "application/json");
  BOOST_REQUIRE(r);
  BOOST_REQUIRE_MESSAGE(r->status == want, path << ": " << r->status << " " << r->body);
  return json::parse(r->body);
}

// kill -9 at random moments while prompts are being prefilled and their blocks written; after
// every restart the daemon is healthy and a probe sharing the prefix answers exactly as a fresh
// daemon does. Whatever the cache kept across the crashes is used, and nothing corrupt is.
BOOST_AUTO_TEST_CASE(kill_9_at_random_moments_loses_nothing_committed_and_serves_nothing_corrupt) {
  const std::vector<int> base = Ids(640, 3);
  const std::vector<int> probe = Concat(base, Ids(50, 4));
  const Answer reference = Fresh(probe);
  TempDir tmp;
  std::mt19937 rng(20261130);
  int64_t most_cached = 0;
  std::string session;
  size_t committed = 0;  // Turns the session had when last seen.
  const json settings = {{"temperature", 0}, {"max_tokens", 4}};
  auto turn = [&](httplib::Client& c, int n) {
    return c.Post(
        "/v1/sessions/" + session + "/turns",
        json{{"messages", {{{"role", "user"}, {"content", "step " + std::to_string(n)}}}}}.dump(),
        "application/json");
  };
  for (int round = 0; round < 6; ++round) {
    DaemonProcess d({tmp.path(), "", {}, {}});
    BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
    auto c = Client(d);
    const Answer got = Ask(*c, probe);
    BOOST_TEST(Same(got, reference), "round " << round << ": " << got.raw);
    most_cached = std::max(most_cached, got.cached);
    // The session: every turn committed before a kill is there, whole, after it.
    if (session.empty()) {
      session =
          Post(*c, "/v1/sessions", {{"system", "You help."}, {"settings", settings}}, 201)["id"];
    }
    const json seen = Get(*c, "/v1/sessions/" + session);
    const size_t turns = seen["turns"].get<size_t>();
    BOOST_TEST((turns == committed || turns == committed + 1), "round " << round << ": " << turns);
    BOOST_TEST(seen["conversation"].size() == 2 * turns, seen.dump());
    auto done = turn(*c, round);
    BOOST_REQUIRE(done);
    BOOST_TEST(done->status == 200, done->body);
    committed = turns + 1;
    // A longer prompt and another turn in flight, and the kill somewhere inside them.
    std::thread writer([&, round] {
      auto w = Client(d);
      Ask(*w, Concat(base, Ids(600, 100 + round)), 32);
      turn(*w, 100 + round);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 1500));
    BOOST_TEST(d.Stop(SIGKILL) == 128 + SIGKILL);
    writer.join();
  }
  // A clean start after the last crash: the cache is still whole and still used.
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto c = Client(d);
  const Answer last = Ask(*c, probe);
  BOOST_TEST(Same(last, reference));
  most_cached = std::max(most_cached, last.cached);
  BOOST_TEST(most_cached > 0);
  const json final_session = Get(*c, "/v1/sessions/" + session);
  BOOST_TEST(final_session["turns"].get<size_t>() >= committed);
  BOOST_TEST(final_session["conversation"].size() == 2 * final_session["turns"].get<size_t>());
  BOOST_TEST(Metric(*c, "flashd_prefix_cache_corruptions_total") == 0);
}

// A pinned prefix stays whole while the disk quota evicts everything else, survives a restart,
// and goes when unpinned.
BOOST_AUTO_TEST_CASE(pins_survive_the_quota_and_restarts) {
  TempDir tmp;
  const std::string config =
      "server:\n  shutdown_grace_seconds: 5\ncache:\n  disk_quota_bytes: 600KiB\n";
  std::string text;
  for (int i = 0; i < 120; ++i) text += "tool number " + std::to_string(i) + " reads a file; ";
  std::vector<int> pinned_ids;
  {
    DaemonProcess d({tmp.path(), config, {}, {}});
    BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
    auto c = Client(d);
    auto pin = c->Post("/v1/cache/pins", json{{"name", "tools"}, {"text", text}}.dump(),
                       "application/json");
    BOOST_REQUIRE(pin);
    BOOST_REQUIRE_MESSAGE(pin->status == 201, pin->body);
    const json p = json::parse(pin->body);
    BOOST_TEST(p["blocks"].get<int>() >= 8);
    auto tok = c->Post("/tokenize", json{{"text", text}}.dump(), "application/json");
    // A text pin is a completion prompt: the beginning-of-sentence token, then the text.
    pinned_ids = Concat({0}, json::parse(tok->body)["tokens"].get<std::vector<int>>());
    BOOST_TEST(static_cast<int>(pinned_ids.size()) == p["tokens"].get<int>());
    // Other prompts, several times the quota.
    for (int i = 0; i < 8; ++i) BOOST_REQUIRE(Ask(*c, Ids(700, 50 + i), 2).status == 200);
    json stats;
    for (int i = 0; i < 50; ++i) {
      stats = Get(*c, "/v1/cache");
      if (stats["disk_bytes"].get<uint64_t>() <= 600 * 1024) break;
      std::this_thread::sleep_for(100ms);
    }
    BOOST_TEST(stats["evictions"].get<int>() > 0, stats.dump());
    BOOST_TEST(stats["disk_bytes"].get<uint64_t>() <= 600u * 1024, stats.dump());
    BOOST_TEST(stats["pins"][0]["name"] == "tools");
    // The pinned prefix is restored whole: its end state was pinned too.
    const Answer hit = Ask(*c, Concat(pinned_ids, Ids(30, 99)));
    BOOST_TEST(hit.cached == static_cast<int64_t>(pinned_ids.size()), hit.raw);
    BOOST_TEST(d.Stop(SIGTERM) == 0);
  }
  DaemonProcess d({tmp.path(), config, {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto c = Client(d);
  BOOST_TEST(Get(*c, "/v1/cache")["pins"].size() == 1u);
  const Answer again = Ask(*c, Concat(pinned_ids, Ids(30, 98)));
  BOOST_TEST(again.cached == static_cast<int64_t>(pinned_ids.size()), again.raw);
  auto del = c->Delete("/v1/cache/pins/tools");
  BOOST_REQUIRE(del);
  BOOST_TEST(del->status == 200, del->body);
  BOOST_TEST(c->Delete("/v1/cache/pins/tools")->status == 404);
  BOOST_TEST(Get(*c, "/v1/cache")["pins"].empty());
  // Bad pins are refused, naming the field.
  auto bad =
      c->Post("/v1/cache/pins", json{{"name", "a b"}, {"text", "x"}}.dump(), "application/json");
  BOOST_TEST(bad->status == 400);
  BOOST_TEST(Contains(bad->body, "name"), bad->body);
  auto none = c->Post("/v1/cache/pins", json{{"name", "x"}}.dump(), "application/json");
  BOOST_TEST(none->status == 400);
}

// API keys name tenants; a tenant never reads another's cache; keys are required on TCP.
BOOST_AUTO_TEST_CASE(tenants_are_isolated_and_keys_are_checked) {
  TempDir tmp;
  const std::string alice = "alice-key-0123456789", bob = "bob-key-0123456789ab";
  const std::string config =
      "server:\n  shutdown_grace_seconds: 5\nauth:\n  keys:\n    alice: " + alice +
      "\n    bob: " + bob + "\n";
  DaemonProcess d({tmp.path(), config, {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto as = [&](const std::string& key) {
    auto c = Client(d);
    if (!key.empty()) c->set_default_headers({{"Authorization", "Bearer " + key}});
    return c;
  };
  const std::vector<int> p = Ids(400, 7), longer = Concat(p, Ids(20, 8));
  BOOST_TEST(Ask(*as(""), p).status == 401);
  const Answer wrong = Ask(*as("alice-key-0123456780"), p);
  BOOST_TEST(wrong.status == 401);
  BOOST_TEST(Contains(wrong.raw, "authentication_error"), wrong.raw);
  BOOST_TEST(as("")->Get("/health")->status == 200);
  BOOST_TEST(Ask(*as(alice), p).status == 200);
  BOOST_TEST(Ask(*as(bob), longer).cached == 0);  // Bob's identical prefix: nothing from Alice.
  BOOST_TEST(Ask(*as(alice), longer).cached == 400);
  // x-api-key works as well (the Anthropic SDKs send it).
  auto x = Client(d);
  x->set_default_headers({{"x-api-key", bob}});
  BOOST_TEST(Ask(*x, Concat(longer, Ids(5, 9))).cached == 420);  // Bob's own earlier prompt.
  // The socket admits its users without a key, each user (SO_PEERCRED) its own tenant.
  auto u = UnixClient(d, 300);
  const Answer local = Ask(*u, longer);
  BOOST_TEST(local.status == 200);
  BOOST_TEST(local.cached == 0);
  BOOST_TEST(Get(*u, "/v1/cache")["tenant"] == "uid-" + std::to_string(::geteuid()));
  const json alice_cache = Get(*as(alice), "/v1/cache");
  BOOST_TEST(alice_cache["tenant"] == "alice");
  // Alice's usage: two answered requests, 820 prompt tokens, 400 of them from the cache.
  BOOST_TEST(alice_cache["usage"]["requests"] == 2, alice_cache.dump());
  BOOST_TEST(alice_cache["usage"]["prompt_tokens"] == 820);
  BOOST_TEST(alice_cache["usage"]["cached_tokens"] == 400);
  BOOST_TEST(d.Stop(SIGTERM) == 0);
  BOOST_TEST(!Contains(d.log(), alice), "a key was logged");
  BOOST_TEST(!Contains(d.log(), bob), "a key was logged");
}

// Sessions: the client sends only what is new; each turn resumes the previous one from the
// cache; sessions survive a restart; a fork shares its origin's prefix.
BOOST_AUTO_TEST_CASE(sessions_keep_the_conversation_across_turns_restarts_and_forks) {
  TempDir tmp;
  std::string id;
  json turn1, turn2;
  const json settings = {{"temperature", 0}, {"max_tokens", 6}};
  {
    DaemonProcess d({tmp.path(), "", {}, {}});
    BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
    auto c = Client(d);
    const json created = Post(
        *c, "/v1/sessions",
        {{"title", "refactor"},
         {"system", "You are a coding agent working on a C++ daemon."},
         {"tools",
          json::array(
              {{{"type", "function"},
                {"function", {{"name", "read_file"}, {"parameters", {{"type", "object"}}}}}}})},
         {"settings", settings}},
        201);
    id = created["id"];
    BOOST_TEST(id.rfind("sess_", 0) == 0u);
    turn1 = Post(*c, "/v1/sessions/" + id + "/turns",
                 {{"messages", {{{"role", "user"}, {"content", "Read main.cc"}}}}}, 200);
    BOOST_TEST(turn1["object"] == "chat.completion");
    turn2 = Post(*c, "/v1/sessions/" + id + "/turns",
                 {{"messages", {{{"role", "user"}, {"content", "And now util.cc"}}}}}, 200);
    // Everything up to the end of turn 1's prompt came from the cache.
    BOOST_TEST(turn2["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>() >=
                   turn1["usage"]["prompt_tokens"].get<int>(),
               turn2["usage"].dump());
    BOOST_TEST(d.Stop(SIGTERM) == 0);
  }
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto c = Client(d);
  const json got = Get(*c, "/v1/sessions/" + id);
  BOOST_TEST(got["turns"] == 2);
  BOOST_TEST(got["head_key"].is_string(), got.dump());  // Its last prompt's entries, stored.
  BOOST_TEST(got["snapshot_key"].is_string(), got.dump());
  BOOST_TEST(got["conversation"].size() == 4u);  // Two user messages, two replies.
  BOOST_TEST(got["conversation"][1]["role"] == "assistant");
  BOOST_TEST(got["cached_tokens"].get<int>() > 0, got.dump());
  const json turn3 = Post(*c, "/v1/sessions/" + id + "/turns",
                          {{"messages", {{{"role", "user"}, {"content", "Thanks"}}}}}, 200);
  BOOST_TEST(turn3["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>() >=
                 turn2["usage"]["prompt_tokens"].get<int>(),
             turn3["usage"].dump());
  // A fork after turn 1 continues from there, sharing that prefix.
  const json fork = Post(*c, "/v1/sessions/" + id + "/fork", {{"turn", 1}}, 201);
  BOOST_TEST(fork["turns"] == 1);
  const json branch = Post(*c, "/v1/sessions/" + fork["id"].get<std::string>() + "/turns",
                           {{"messages", {{{"role", "user"}, {"content", "Other idea"}}}}}, 200);
  BOOST_TEST(branch["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>() >=
                 turn1["usage"]["prompt_tokens"].get<int>(),
             branch["usage"].dump());
  BOOST_TEST(Get(*c, "/v1/sessions")["data"].size() == 2u);
  BOOST_TEST(Get(*c, "/v1/sessions/" + id)["turns"] == 3);
  // Errors name what is wrong; deleting leaves the other session.
  Post(*c, "/v1/sessions/" + id + "/turns", {{"messages", json::array()}}, 400);
  Post(*c, "/v1/sessions/sess_nope/turns", {{"messages", {{{"role", "user"}, {"content", "x"}}}}},
       404);
  Post(*c, "/v1/sessions/" + id + "/fork", {{"turn", 9}}, 400);
  Post(*c, "/v1/sessions", {{"settings", {{"colour", 1}}}}, 400);
  BOOST_TEST(c->Delete("/v1/sessions/" + id)->status == 200);
  BOOST_TEST(c->Get("/v1/sessions/" + id)->status == 404);
  BOOST_TEST(Get(*c, "/v1/sessions")["data"].size() == 1u);
}

// Over the socket, the connecting user names the tenant: another user's identical prompt finds
// nothing of the first one's. (Needs root to connect as a second user.)
BOOST_AUTO_TEST_CASE(socket_users_are_tenants_by_uid) {
  TempDir tmp;
  DaemonProcess d(
      {tmp.path(), "server:\n  socket_mode: \"0666\"\n  shutdown_grace_seconds: 5\n", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto u = UnixClient(d, 300);
  const std::vector<int> p = Ids(300, 21), longer = Concat(p, Ids(10, 22));
  BOOST_TEST(Ask(*u, p).cached == 0);
  BOOST_TEST(Ask(*u, longer).cached == 300);
  BOOST_TEST(Get(*u, "/v1/cache")["tenant"] == "uid-" + std::to_string(::geteuid()));
  if (::geteuid() != 0) {
    BOOST_TEST_MESSAGE("not root: cannot connect as a second user; that half is skipped");
    return;
  }
  std::filesystem::permissions(tmp.path(), std::filesystem::perms::all);
  std::filesystem::permissions(std::filesystem::path(d.socket_path()).parent_path(),
                               std::filesystem::perms::all);
  const std::filesystem::path body = tmp.path() / "body.json";
  std::ofstream(body) << json{{"prompt", longer}, {"max_tokens", 2}, {"temperature", 0}}.dump();
  std::filesystem::permissions(body, std::filesystem::perms::all);
  const CommandResult r = RunCommand(
      "setpriv --reuid=65534 --regid=65534 --clear-groups curl -s "
      "--unix-socket " +
      d.socket_path() + " http://flashd/v1/completions --json @" + body.string());
  BOOST_REQUIRE_MESSAGE(r.code == 0, r.out);
  const json other = json::parse(r.out);
  BOOST_TEST(other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, r.out);
}

// Start-up reconciles the catalog with the store: with the cache lost, pins pointing at it are
// dropped and sessions keep working with their keys cleared.
BOOST_AUTO_TEST_CASE(rows_pointing_at_lost_entries_are_repaired_or_dropped_at_start) {
  TempDir tmp;
  std::string id;
  {
    DaemonProcess d({tmp.path(), "", {}, {}});
    BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
    auto c = Client(d);
    Post(*c, "/v1/cache/pins", {{"name", "p"}, {"text", std::string(400, 'a')}}, 201);
    id = Post(*c, "/v1/sessions", {{"system", "S"}, {"settings", {{"max_tokens", 2}}}}, 201)["id"];
    Post(*c, "/v1/sessions/" + id + "/turns",
         {{"messages", {{{"role", "user"}, {"content", "hi"}}}}}, 200);
    BOOST_TEST(Get(*c, "/v1/sessions/" + id)["snapshot_key"].is_string());
    BOOST_TEST(d.Stop(SIGTERM) == 0);
  }
  std::filesystem::remove_all(tmp.path() / "state" / "cache");  // The disk lost the cache.
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto c = Client(d);
  BOOST_TEST(Get(*c, "/v1/cache")["pins"].empty());
  const json s = Get(*c, "/v1/sessions/" + id);
  BOOST_TEST(s["turns"] == 1);
  BOOST_TEST(s["snapshot_key"].is_null(), s.dump());
  Post(*c, "/v1/sessions/" + id + "/turns",
       {{"messages", {{{"role", "user"}, {"content", "again"}}}}}, 200);
  BOOST_TEST(Contains(d.log(), "lost its blocks; dropped"), d.log());
}

// A prefix published to a group serves its members, and only them.
BOOST_AUTO_TEST_CASE(a_prefix_published_to_a_group_is_shared_with_its_members_only) {
  TempDir tmp;
  const std::string alice = "alice-key-0123456789", bob = "bob-key-0123456789ab",
                    carol = "carol-key-0123456789";
  const std::string config =
      "server:\n  shutdown_grace_seconds: 5\nauth:\n  keys:\n    alice: " + alice +
      "\n    bob: " + bob + "\n    carol: " + carol + "\n  groups:\n    team: [alice, bob]\n";
  DaemonProcess d({tmp.path(), config, {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto as = [&](const std::string& key) {
    auto c = Client(d);
    c->set_default_headers({{"Authorization", "Bearer " + key}});
    return c;
  };
  std::string text;
  for (int i = 0; i < 60; ++i) text += "shared tool " + std::to_string(i) + " does a thing; ";
  const json pin = Post(*as(alice), "/v1/cache/pins",
                        {{"name", "team-tools"}, {"text", text}, {"group", "team"}}, 201);
  BOOST_TEST(pin["group"] == "team");
  auto tok = as(alice)->Post("/tokenize", json{{"text", text}}.dump(), "application/json");
  const std::vector<int> ids =
      Concat({0}, json::parse(tok->body)["tokens"].get<std::vector<int>>());
  const std::vector<int> prompt = Concat(ids, Ids(20, 5));
  // Bob never sent it, and starts from the group's copy; Carol is no member.
  BOOST_TEST(Ask(*as(bob), prompt).cached == static_cast<int64_t>(ids.size()));
  BOOST_TEST(Ask(*as(carol), prompt).cached == 0);
  auto denied = as(carol)->Post("/v1/cache/pins",
                                json{{"name", "x"}, {"text", text}, {"group", "team"}}.dump(),
                                "application/json");
  BOOST_TEST(denied->status == 403);
  const json bobs = Get(*as(bob), "/v1/cache");
  BOOST_TEST(bobs["groups"] == json::array({"team"}));
  BOOST_REQUIRE(bobs["pins"].size() == 1u);
  BOOST_TEST(bobs["pins"][0]["group"] == "team");
  BOOST_TEST(Get(*as(carol), "/v1/cache")["pins"].empty());
  BOOST_TEST(as(bob)->Delete("/v1/cache/pins/team-tools?group=team")->status == 200);
}

// Disk full, as a file-size limit on the daemon: cache writes fail and stop, /health says
// degraded, and requests are still answered, exactly.
BOOST_AUTO_TEST_CASE(a_full_disk_degrades_the_cache_but_serving_goes_on) {
  TempDir tmp;
  DaemonProcess d({tmp.path(), "", {}, {}});
  d.set_wrapper({"/usr/bin/prlimit", "--fsize=" + std::to_string(1 << 20)});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto c = Client(d);
  // More KV than a megabyte: the write-ahead log reaches the limit.
  for (int i = 0; i < 8 && Get(*c, "/health")["status"] != "degraded"; ++i) {
    BOOST_REQUIRE(Ask(*c, Ids(1200, 200 + i), 2).status == 200);
    for (int j = 0; j < 20 && Metric(*c, "flashd_prefix_cache_degraded") != 1; ++j) {
      std::this_thread::sleep_for(50ms);
    }
  }
  auto health = c->Get("/health");
  BOOST_TEST(health->status == 200);  // Degraded, not down.
  BOOST_TEST(Contains(health->body, "\"status\":\"degraded\""), health->body);
  BOOST_TEST(Metric(*c, "flashd_prefix_cache_write_failures_total") >= 1);
  const std::vector<int> p = Ids(300, 300);
  const Answer a = Ask(*c, p);
  BOOST_TEST(Same(a, Fresh(p)), a.raw);
  BOOST_TEST(Contains(d.log(), "no more entries are written"), d.log());
}

BOOST_AUTO_TEST_CASE(a_public_address_without_keys_refuses_to_start) {
  TempDir tmp;
  DaemonProcess d({tmp.path(), "", {{"FLASHD_LISTEN", "0.0.0.0:0"}}, {}});
  BOOST_TEST(!d.Start());
  BOOST_TEST(d.Wait() == 2);
  BOOST_TEST(Contains(d.log(), "is not a loopback address; serving it needs API keys"), d.log());
}

// A cache left by a build that wrote another block layout (which recorded no payload format) is
// found at start-up, dropped with one log line, and never read: the daemon answers as a fresh
// one and fills the cache again.
BOOST_AUTO_TEST_CASE(a_cache_in_an_older_format_is_dropped_at_start_up) {
  const std::vector<int> prompt = Ids(300, 9);
  TempDir tmp;
  {
    DaemonProcess d({tmp.path(), "", {}, {}});
    BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
    BOOST_REQUIRE(Ask(*Client(d), prompt).status == 200);
    BOOST_TEST(d.Stop(SIGTERM) == 0);
  }
  // Make the store what an older build left: the same entries, no recorded format.
  {
    const std::string dir = (tmp.path() / "state" / "cache").string();
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
        {rocksdb::kDefaultColumnFamilyName, {}}, {"blocks", {}}, {"snapshots", {}}, {"meta", {}}};
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* raw = nullptr;
    rocksdb::Status s = rocksdb::DB::Open(rocksdb::Options(), dir, cfs, &handles, &raw);
    BOOST_REQUIRE_MESSAGE(s.ok(), s.ToString());
    std::unique_ptr<rocksdb::DB> db(raw);
    BOOST_REQUIRE(db->Delete(rocksdb::WriteOptions(), handles[0], "payload_format").ok());
    for (auto* h : handles) db->DestroyColumnFamilyHandle(h);
  }
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto c = Client(d);
  const std::string log = d.log();
  size_t lines = 0;
  for (size_t at = log.find("older format"); at != std::string::npos;
       at = log.find("older format", at + 1)) {
    ++lines;
  }
  BOOST_TEST(lines == 1u, log);
  BOOST_TEST(Metric(*c, "flashd_prefix_cache_snapshots") == 0);
  BOOST_TEST(Metric(*c, "flashd_prefix_cache_blocks") == 0);
  const Answer again = Ask(*c, prompt);
  BOOST_TEST(again.cached == 0);
  BOOST_TEST(Same(again, Fresh(prompt)), again.raw);
  // The blocks are written behind the answer.
  for (int i = 0; i < 100 && Metric(*c, "flashd_prefix_cache_blocks") < 4; ++i) {
    std::this_thread::sleep_for(100ms);
  }
  BOOST_TEST(Metric(*c, "flashd_prefix_cache_blocks") >= 4);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::testing
