// Fault injection against the real daemon: its block store (RocksDB) and catalog (SQLite) get the
// errors a failing or full disk gives (write errors, ENOSPC, short writes, fsync failures, through
// tests/support/fault_inject.c preloaded into the daemon), and find their files truncated or
// corrupted at restart. Each case ends with the daemon serving, exactly, and nothing committed
// before the fault lost.
#include <httplib.h>
#include <signal.h>

#include <boost/test/unit_test.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "tests/e2e/daemon_process.h"
#include "tests/e2e/exact_answers.h"

namespace flashd::testing {
namespace {
using nlohmann::json;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

json Get(httplib::Client& c, const std::string& path) {
  auto r = c.Get(path);
  return r ? json::parse(r->body, nullptr, false) : json();
}

std::string NewSession(httplib::Client& c) {
  auto r = c.Post(
      "/v1/sessions",
      json{{"system", "You help."}, {"settings", {{"max_tokens", 3}, {"temperature", 0}}}}.dump(),
      "application/json");
  return r && r->status == 201 ? json::parse(r->body)["id"].get<std::string>() : "";
}

int Turn(httplib::Client& c, const std::string& id, const std::string& text) {
  auto r = c.Post("/v1/sessions/" + id + "/turns",
                  json{{"messages", {{{"role", "user"}, {"content", text}}}}}.dump(),
                  "application/json");
  return r ? r->status : -1;
}

std::vector<std::string> UserTurns(httplib::Client& c, const std::string& id) {
  std::vector<std::string> out;
  const json s = Get(c, "/v1/sessions/" + id);
  if (!s.contains("conversation")) return out;
  for (const json& m : s["conversation"]) {
    if (m["role"] == "user") out.push_back(m["content"]);
  }
  return out;
}

DaemonProcess::Options Faulty(const TempDir& tmp, const std::string& mode,
                              const std::string& path_part) {
  return {tmp.path(),
          "",
          {{"LD_PRELOAD", FLASHD_FAULT_LIB},
           // In a sanitizer build the preloaded library comes before ASan's runtime; allowed.
           {"ASAN_OPTIONS", "verify_asan_link_order=0:detect_leaks=1:abort_on_error=1"},
           {"FLASHD_FAULT", mode},
           {"FLASHD_FAULT_PATH", path_part},
           {"FLASHD_FAULT_FILE", (tmp.path() / "faults-on").string()}},
          {}};
}

void FaultsOn(const TempDir& tmp) { std::ofstream(tmp.path() / "faults-on") << "1"; }
void FaultsOff(const TempDir& tmp) { fs::remove(tmp.path() / "faults-on"); }

bool WaitDegraded(httplib::Client& c, std::chrono::seconds timeout = 20s) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (Get(c, "/health").value("status", "") == "degraded") return true;
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

BOOST_AUTO_TEST_SUITE(fault_injection)

// The block store's writes fail (EIO, or ENOSPC as on a full disk) while the daemon runs: cache
// writes stop, /health says degraded, every answer stays exact, committed session turns and
// cached prefixes are there after a restart on a healthy disk.
BOOST_AUTO_TEST_CASE(cache_write_errors_degrade_serving_exactly_and_lose_nothing) {
  const std::vector<int> p1 = Ids(700, 1), p2 = Ids(500, 2);
  const Answer fresh1 = Fresh(p1), fresh2 = Fresh(p2);
  BOOST_REQUIRE(fresh1.status == 200 && fresh2.status == 200);
  for (const std::string mode : {"eio", "enospc"}) {
    BOOST_TEST_CONTEXT("mode " << mode) {
      TempDir tmp;
      std::string session;
      {
        DaemonProcess d(Faulty(tmp, mode, "/cache/"));
        BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
        auto c = TcpClient(d, 300);
        session = NewSession(*c);
        BOOST_REQUIRE(!session.empty());
        BOOST_TEST(Turn(*c, session, "before the fault") == 200);
        BOOST_TEST(Same(Ask(*c, p1), fresh1));
        FaultsOn(tmp);
        const Answer during = Ask(*c, p2);
        BOOST_TEST(Same(during, fresh2), during.raw);
        BOOST_TEST(WaitDegraded(*c), Get(*c, "/health").dump());
        BOOST_TEST(Turn(*c, session, "during the fault") == 200);
        // Served from what the cache kept, still exact.
        BOOST_TEST(Same(Ask(*c, p1), fresh1));
        BOOST_TEST(Metric(*c, "flashd_prefix_cache_write_failures_total") >= 1);
        FaultsOff(tmp);
        BOOST_TEST(d.Stop(SIGTERM) == 0, d.log());
        BOOST_TEST(!Contains(d.log(), "Assertion"), d.log());
      }
      DaemonProcess d({tmp.path(), "", {}, {}});
      BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
      auto c = TcpClient(d, 300);
      BOOST_TEST(Get(*c, "/health")["status"] == "ok");
      const std::vector<std::string> turns = UserTurns(*c, session);
      BOOST_TEST(turns == (std::vector<std::string>{"before the fault", "during the fault"}));
      const Answer again = Ask(*c, p1);
      BOOST_TEST(Same(again, fresh1), again.raw);
      BOOST_TEST(again.cached > 0, again.raw);  // Written before the fault, still used.
    }
  }
}

// Every write of the block store and the catalog comes back short (half its bytes): the
// writers loop, nothing is corrupted, a restart restores exactly.
BOOST_AUTO_TEST_CASE(short_writes_are_completed_and_corrupt_nothing) {
  const std::vector<int> p = Ids(600, 3);
  const Answer fresh = Fresh(p);
  TempDir tmp;
  std::string session;
  {
    FaultsOn(tmp);
    DaemonProcess d(Faulty(tmp, "short", "/state/"));
    BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
    auto c = TcpClient(d, 300);
    session = NewSession(*c);
    BOOST_REQUIRE(!session.empty());
    BOOST_TEST(Turn(*c, session, "one") == 200);
    BOOST_TEST(Same(Ask(*c, p), fresh));
    BOOST_TEST(Get(*c, "/health")["status"] == "ok");
    BOOST_TEST(d.Stop(SIGTERM) == 0, d.log());
  }
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto c = TcpClient(d, 300);
  const Answer again = Ask(*c, p);
  BOOST_TEST(Same(again, fresh), again.raw);
  BOOST_TEST(again.cached > 0, again.raw);
  BOOST_TEST(Metric(*c, "flashd_prefix_cache_corruptions_total") == 0);
  BOOST_TEST(UserTurns(*c, session) == std::vector<std::string>{"one"});
}

// fsync fails from the start: the block store cannot be opened (RocksDB syncs its manifest), the
// daemon serves without the cache and says so; sessions (SQLite syncs too) stay readable once the
// disk is healthy again.
BOOST_AUTO_TEST_CASE(fsync_failures_leave_the_daemon_serving) {
  const std::vector<int> p = Ids(300, 4);
  const Answer fresh = Fresh(p);
  TempDir tmp;
  std::string session;
  {
    DaemonProcess d({tmp.path(), "", {}, {}});
    BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
    auto c = TcpClient(d);
    session = NewSession(*c);
    BOOST_TEST(Turn(*c, session, "kept") == 200);
    BOOST_TEST(d.Stop(SIGTERM) == 0);
  }
  {
    FaultsOn(tmp);
    DaemonProcess d(Faulty(tmp, "fsync", "/state/"));
    BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
    auto c = TcpClient(d);
    BOOST_TEST(Same(Ask(*c, p), fresh));
    BOOST_TEST(Get(*c, "/health")["status"] == "degraded", Get(*c, "/health").dump());
    BOOST_TEST(d.Stop(SIGTERM) == 0, d.log());
  }
  FaultsOff(tmp);
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto c = TcpClient(d);
  BOOST_TEST(Get(*c, "/health")["status"] == "ok");
  BOOST_TEST(UserTurns(*c, session) == std::vector<std::string>{"kept"});
}

// The catalog's writes fail: a turn that cannot be saved is not kept (and says so in the log),
// a new session is refused with an error, earlier turns stay, and serving goes on.
BOOST_AUTO_TEST_CASE(catalog_write_errors_keep_every_committed_turn) {
  TempDir tmp;
  std::string session;
  {
    DaemonProcess d(Faulty(tmp, "eio", "catalog.db"));
    BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
    auto c = TcpClient(d);
    session = NewSession(*c);
    BOOST_REQUIRE(!session.empty());
    BOOST_TEST(Turn(*c, session, "committed") == 200);
    FaultsOn(tmp);
    // The reply was generated but cannot be kept: the client is told so, not handed a turn that
    // the session will not have.
    auto lost = c->Post(
        "/v1/sessions/" + session + "/turns",
        json{{"messages", {{{"role", "user"}, {"content", "while the catalog fails"}}}}}.dump(),
        "application/json");
    BOOST_REQUIRE(lost);
    BOOST_TEST(Contains(lost->body, "could not be saved"), lost->body);
    BOOST_TEST(!Contains(lost->body, "\"choices\""), lost->body);
    auto refused = c->Post("/v1/sessions", "{}", "application/json");
    BOOST_REQUIRE(refused);
    BOOST_TEST(refused->status >= 500, refused->body);
    BOOST_TEST(json::parse(refused->body, nullptr, false).contains("error"), refused->body);
    BOOST_TEST(Ask(*c, Ids(100, 5)).status == 200);
    FaultsOff(tmp);
    BOOST_TEST(Turn(*c, session, "after") == 200);
    BOOST_TEST(d.Stop(SIGTERM) == 0, d.log());
  }
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto c = TcpClient(d);
  const std::vector<std::string> turns = UserTurns(*c, session);
  BOOST_TEST(turns == (std::vector<std::string>{"committed", "after"}));
}

// Files damaged while the daemon was down: a truncated write-ahead log, corrupted table files,
// a truncated catalog. The daemon starts, serves exactly, and never uses a damaged entry.
BOOST_AUTO_TEST_CASE(truncated_or_corrupted_files_at_restart) {
  const std::vector<int> p = Ids(700, 6);
  const Answer fresh = Fresh(p);
  TempDir tmp;
  const fs::path cache = tmp.path() / "state" / "cache";
  auto run_once = [&] {
    DaemonProcess d({tmp.path(), "", {}, {}});
    BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
    auto c = TcpClient(d, 300);
    const Answer a = Ask(*c, p);
    BOOST_TEST(Same(a, fresh), a.raw);
    BOOST_TEST(Get(*c, "/health")["status"] == "ok", Get(*c, "/health").dump());
    BOOST_TEST(Metric(*c, "flashd_prefix_cache_corruptions_total") >= 0);  // The cache is on.
    BOOST_TEST(d.Stop(SIGTERM) == 0, d.log());
    return a;
  };
  run_once();
  // The write-ahead log cut in the middle of a record.
  for (const auto& e : fs::directory_iterator(cache)) {
    if (e.path().extension() == ".log" && fs::file_size(e.path()) > 100) {
      fs::resize_file(e.path(), fs::file_size(e.path()) / 2);
    }
  }
  run_once();
  // Table files with bytes flipped in their data.
  {
    DaemonProcess d({tmp.path(), "", {}, {}});
    BOOST_REQUIRE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200);
    auto c = TcpClient(d, 300);
    BOOST_TEST(Same(Ask(*c, p), fresh));
    // Flushed to table files by a clean stop.
    BOOST_TEST(d.Stop(SIGTERM) == 0);
  }
  int damaged = 0;
  for (const auto& e : fs::directory_iterator(cache)) {
    if (e.path().extension() != ".sst" && e.path().extension() != ".log") continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    const auto size = static_cast<std::streamoff>(fs::file_size(e.path()));
    for (std::streamoff at = 64; at < size - 64; at += 997) {
      f.seekp(at);
      f.put('\x5a');
    }
    ++damaged;
  }
  BOOST_TEST(damaged > 0);
  run_once();
  // The catalog cut in half: sessions are unavailable, the cache and generation keep working.
  const fs::path catalog = tmp.path() / "state" / "catalog.db";
  fs::resize_file(catalog, fs::file_size(catalog) / 2);
  DaemonProcess d({tmp.path(), "", {}, {}});
  BOOST_REQUIRE_MESSAGE(d.Start() && WaitHealthy("127.0.0.1", d.port()) == 200, d.log());
  auto c = TcpClient(d, 300);
  BOOST_TEST(Same(Ask(*c, p), fresh));
  BOOST_TEST(Metric(*c, "flashd_prefix_cache_hit_tokens_total") > 0);  // The cache still works.
  auto h = c->Get("/health");
  BOOST_REQUIRE(h);
  BOOST_TEST(h->status == 200);
  BOOST_TEST(Contains(h->body, "sessions and pins are unavailable"), h->body);
  auto sessions = c->Get("/v1/sessions");
  BOOST_REQUIRE(sessions);
  BOOST_TEST(sessions->status == 503, sessions->body);
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::testing
