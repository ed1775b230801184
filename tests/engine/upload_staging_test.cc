// UploadStaging against a device that runs queued copies only when the host waits for it: each
// destination must end with the bytes its upload was given, whatever the host wrote after.
#include "engine/upload_staging.h"

#include <boost/test/unit_test.hpp>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace flashd::engine {
namespace {

// A device that defers every queued copy until a wait (or a plain copy, which comes after
// them), so a staging byte written again too early shows in the destination.
struct Deferred {
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  std::vector<Copy> queue;
  std::vector<uint8_t> pinned;  // The staging's memory while it is allocated.
  int waits = 0, plain = 0;
  size_t most_pending = 0;  // The most bytes queued at once.
  bool refuse_pinned = false;
  bool freed_while_queued = false;  // The staging freed while a copy still read it.

  void Drain() {
    for (const Copy& c : queue) std::memcpy(c.dst, c.src, c.bytes);
    queue.clear();
  }
};

struct DeferredDevice {
  Deferred* d;
  std::string HostAlloc(void** ptr, size_t bytes) {
    if (d->refuse_pinned) return "no pinned memory";
    d->pinned.assign(bytes, 0xAA);
    *ptr = d->pinned.data();
    return "";
  }
  void HostFree(void*) {
    d->freed_while_queued = d->freed_while_queued || !d->queue.empty();
    d->pinned.clear();
  }
  std::string Queue(void* dst, const void* src, size_t bytes) {
    d->queue.push_back({dst, src, bytes});
    size_t pending = 0;
    for (const Deferred::Copy& c : d->queue) pending += c.bytes;
    d->most_pending = std::max(d->most_pending, pending);
    return "";
  }
  std::string Copy(void* dst, const void* src, size_t bytes) {
    ++d->plain;
    d->Drain();
    std::memcpy(dst, src, bytes);
    return "";
  }
  std::string Wait() {
    ++d->waits;
    d->Drain();
    return "";
  }
};

BOOST_AUTO_TEST_SUITE(upload_staging)

// Hundreds of uploads of 1 byte to 3 KiB through 16 KiB of staging, the source rewritten after
// each, the caller waiting at random points too: every destination gets its own bytes, the
// staging waits for itself when full, and no more than its bytes are ever queued.
BOOST_AUTO_TEST_CASE(every_upload_lands_with_the_bytes_it_was_given) {
  for (bool refuse : {false, true}) {
    Deferred device;
    device.refuse_pinned = refuse;
    std::mt19937 rng(7);
    std::vector<std::vector<uint8_t>> want, got;
    size_t caller_waits = 0;
    {
      UploadStaging<DeferredDevice> staging(DeferredDevice{&device}, 16 << 10, 4 << 10);
      std::vector<uint8_t> source(3 << 10);
      for (int i = 0; i < 600; ++i) {
        const size_t bytes = 1 + rng() % source.size();
        for (size_t b = 0; b < bytes; ++b) source[b] = static_cast<uint8_t>(rng());
        want.emplace_back(source.begin(), source.begin() + static_cast<long>(bytes));
        got.emplace_back(bytes, 0);
      }
      // Destinations stay put from here on (the copies hold their addresses).
      std::mt19937 again(7);
      for (size_t i = 0; i < want.size(); ++i) {
        std::memcpy(source.data(), want[i].data(), want[i].size());
        BOOST_REQUIRE(staging.Up(got[i].data(), source.data(), want[i].size()).empty());
        std::memset(source.data(), 0x55, source.size());  // The host goes on with its buffer.
        if (again() % 9 == 0) {
          BOOST_REQUIRE(DeferredDevice{&device}.Wait().empty());
          staging.Drained();
          ++caller_waits;
        }
      }
      BOOST_REQUIRE(DeferredDevice{&device}.Wait().empty());
      staging.Drained();
      BOOST_TEST(staging.queued() + staging.copied() == want.size());
      if (refuse) {
        BOOST_TEST(staging.queued() == 0u);
      } else {
        BOOST_TEST(staging.copied() == 0u);
        BOOST_TEST(staging.waits() > 0u);
        BOOST_TEST(device.waits == static_cast<int>(staging.waits() + caller_waits + 1));
        BOOST_TEST(device.most_pending <= size_t{16} << 10);
      }
    }
    BOOST_TEST(device.pinned.empty());  // Freed with the staging.
    size_t wrong = 0;
    for (size_t i = 0; i < want.size(); ++i) wrong += got[i] != want[i];
    BOOST_TEST(wrong == 0u, wrong << " of " << want.size() << " uploads landed other bytes"
                                  << (refuse ? " (no pinned memory)" : ""));
  }
}

// An upload over `largest` is a plain copy, after the queued ones: the last bytes given to a
// destination are the ones it keeps.
BOOST_AUTO_TEST_CASE(a_large_upload_is_a_plain_copy_after_the_queued_ones) {
  Deferred device;
  UploadStaging<DeferredDevice> staging(DeferredDevice{&device}, 64 << 10, 1 << 10);
  std::vector<uint8_t> dst(2 << 10, 0), small(512, 1), large(2 << 10, 2);
  BOOST_REQUIRE(staging.Up(dst.data(), small.data(), small.size()).empty());
  BOOST_TEST(device.queue.size() == 1u);
  BOOST_REQUIRE(staging.Up(dst.data(), large.data(), large.size()).empty());
  BOOST_TEST(device.plain == 1);
  BOOST_TEST(staging.queued() == 1u);
  BOOST_TEST(staging.copied() == 1u);
  BOOST_TEST((dst == large));
  BOOST_REQUIRE(staging.Up(dst.data(), small.data(), small.size()).empty());
  BOOST_TEST((dst == large));  // Queued, not yet done.
  BOOST_REQUIRE(DeferredDevice{&device}.Wait().empty());
  BOOST_TEST(std::memcmp(dst.data(), small.data(), small.size()) == 0);
  BOOST_TEST(dst.back() == 2);
  BOOST_TEST(staging.Up(dst.data(), small.data(), 0).empty());  // Nothing to copy.
  BOOST_TEST(staging.queued() == 2u);
}

// The staging is not freed under copies still queued from it: they land first.
BOOST_AUTO_TEST_CASE(the_staging_outlives_its_queued_copies) {
  Deferred device;
  std::vector<uint8_t> dst(64, 0), src(64, 9);
  {
    UploadStaging<DeferredDevice> staging(DeferredDevice{&device}, 4 << 10, 1 << 10);
    BOOST_REQUIRE(staging.Up(dst.data(), src.data(), src.size()).empty());
    BOOST_TEST(device.queue.size() == 1u);
  }
  BOOST_TEST(!device.freed_while_queued);
  BOOST_TEST((dst == src));
  BOOST_TEST(device.pinned.empty());
}

BOOST_AUTO_TEST_SUITE_END()

}  // namespace
}  // namespace flashd::engine
