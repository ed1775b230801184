// The persistent prefix cache: warm resume after a restart against cold prefill, restore
// throughput from a cold page cache against the disk's sequential read speed measured in the
// same run, and bytes on disk per cached token.
//
//   build/bench/cache_bench MODEL_DIR WORK_DIR [CONTEXT...] [--synthetic CONTEXT...]
//
// For each CONTEXT: a cold engine prefills CONTEXT tokens (time to first token), the engine and
// store close (the restart), the store's files leave the page cache (posix_fadvise DONTNEED:
// containers may not write /proc/sys/vm/drop_caches), and a new engine answers the same prompt
// plus 32 new tokens (time to first token: restore from the snapshot, then 32 tokens of prefill).
// --synthetic contexts are too long to prefill cold on a CPU: their blocks are real blocks' bytes
// repeated under the keys of random tokens, with a snapshot at the end, so the warm resume (and
// only it) is measured at that length.
#include <fcntl.h>
#include <rocksdb/db.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/disk.h"
#include "cache/crc32c.h"
#include "engine/engine.h"

using namespace flashd;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::vector<int32_t> Tokens(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(3, 400);
  std::vector<int32_t> v(n);
  for (int32_t& t : v) t = d(rng);
  return v;
}

uint64_t DirBytes(const fs::path& dir) {
  uint64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) n += e.file_size();
  }
  return n;
}

std::shared_ptr<cache::BlockStore> Store(const fs::path& dir, uint64_t ram = 1ull << 30) {
  cache::StoreOptions o;
  o.dir = (dir / "cache").string();
  o.ram_bytes = ram;
  o.disk_quota_bytes = 1ull << 40;
  auto s = cache::BlockStore::Open(o);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
    std::exit(1);
  }
  return std::shared_ptr<cache::BlockStore>(std::move(s).value());
}

std::unique_ptr<engine::Engine> Open(const std::string& model,
                                     std::shared_ptr<cache::BlockStore> s) {
  engine::EngineOptions o;
  o.model_dir = model;
  o.step_token_budget = 2048;
  o.prefill_chunk = 2048;
  o.memory_budget_bytes = 16ull << 30;
  o.cache = std::move(s);
  auto e = engine::Engine::Open(o);
  if (!e.ok()) {
    std::fprintf(stderr, "%s\n", e.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(e).value();
}

// Seconds from submitting to the first token; the generation then runs to its end.
double TimeToFirstToken(engine::Engine& e, std::vector<int32_t> prompt, int64_t* cached) {
  engine::GenerationRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0;
  r.sampling.max_tokens = 1;
  r.sampling.ignore_eos = true;
  const auto t0 = Clock::now();
  auto [h, q] = e.Submit(std::move(r));
  double first = -1;
  for (;;) {
    auto ev = q->Pop(std::chrono::hours(10));
    if (!ev) continue;
    if (ev->kind == engine::GenerationEvent::Kind::kToken && first < 0) first = Since(t0);
    if (ev->kind == engine::GenerationEvent::Kind::kDone) {
      if (!ev->error.ok()) std::fprintf(stderr, "error: %s\n", ev->error.ToString().c_str());
      *cached = ev->cached_tokens;
      return first;
    }
  }
}

// Writes a fresh file of `bytes` at `path` and reads it sequentially out of the page cache,
// 4 MiB at a time: buffered (returned), and direct into `*direct`. The file stays, so that the
// direct read can be repeated beside each measurement it is compared with.
double RawReadSpeed(const fs::path& path, uint64_t bytes, double* direct) {
  {
    std::vector<char> buf(4 << 20);
    std::mt19937_64 rng(1);
    for (auto& c : buf) c = static_cast<char>(rng());
    FILE* f = std::fopen(path.c_str(), "wb");
    for (uint64_t done = 0; done < bytes; done += buf.size())
      std::fwrite(buf.data(), 1, buf.size(), f);
    std::fclose(f);
  }
  bench::DropDirFromPageCache(path.parent_path());
  const int fd = ::open(path.c_str(), O_RDONLY);
  std::vector<char> buf(4 << 20);
  const auto t = Clock::now();
  uint64_t total = 0;
  for (ssize_t n; (n = ::read(fd, buf.data(), buf.size())) > 0;) total += static_cast<uint64_t>(n);
  const double s = Since(t);
  ::close(fd);
  bench::DropDirFromPageCache(path.parent_path());
  *direct = bench::DirectReadSpeed({path.string()});
  return total / s;
}

struct Chain {
  std::vector<cache::BlockKey> keys;
  std::vector<std::vector<int32_t>> tokens;
};

Chain ChainOf(const std::vector<int32_t>& prompt, const cache::KeyContext& ctx) {
  Chain c;
  cache::BlockKey parent;
  for (size_t j = 0; (j + 1) * 64 <= prompt.size(); ++j) {
    std::vector<int32_t> t(prompt.begin() + j * 64, prompt.begin() + (j + 1) * 64);
    parent = cache::ChainBlockKey(parent, t, ctx);
    c.keys.push_back(parent);
    c.tokens.push_back(std::move(t));
  }
  return c;
}

// Restore throughput: every block of `chain` read back through the store (RAM tier off) after
// the files left the page cache, in MultiGet batches of `batch`, on `threads` threads; with
// `into_blocks`, as the engine's loader reads a restore: the whole chain in one ReadBlocksInto
// call whose reading threads check each payload as they copy it into KV block memory.
// `*cpu_seconds`: the process's user + system CPU time over the read.
double RestoreSpeed(const fs::path& dir, const Chain& chain, size_t batch, int threads,
                    bool into_blocks, double* cpu_seconds) {
  bench::DropDirFromPageCache(dir / "cache");
  auto store = Store(dir, 0);
  std::atomic<uint64_t> bytes{0};
  std::atomic<size_t> next{0};
  rusage u0;
  getrusage(RUSAGE_SELF, &u0);
  const auto t = Clock::now();
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) {
    pool.emplace_back([&] {
      for (size_t at; (at = next.fetch_add(batch)) < chain.keys.size();) {
        const size_t n = std::min(batch, chain.keys.size() - at);
        std::vector<std::span<const int32_t>> spans;
        for (size_t j = at; j < at + n; ++j) spans.push_back(chain.tokens[j]);
        const auto keys = std::span(chain.keys).subspan(at, n);
        if (into_blocks) {
          std::vector<engine::KvPool::BlockMemory> blocks(n);
          std::vector<size_t> sizes(n, 0);
          const auto got = store->ReadBlocksInto(keys, spans, [&](size_t i, size_t size) {
            blocks[i] = engine::KvPool::NewBlockMemory(size);
            sizes[i] = size;
            return blocks[i].get();
          });
          for (size_t i = 0; i < n; ++i) {
            if (got[i]) bytes += sizes[i];
          }
          continue;
        }
        for (auto& p : store->ReadBlocks(keys, spans)) {
          if (p) bytes += p->size();
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  const double s = Since(t);
  rusage u1;
  getrusage(RUSAGE_SELF, &u1);
  auto sec = [](const timeval& v) { return v.tv_sec + v.tv_usec / 1e6; };
  *cpu_seconds = sec(u1.ru_utime) - sec(u0.ru_utime) + sec(u1.ru_stime) - sec(u0.ru_stime);
  return bytes / s;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: cache_bench MODEL_DIR WORK_DIR [CONTEXT...] [--synthetic CONTEXT...]\n");
    return 2;
  }
  const std::string model = argv[1];
  const fs::path work = argv[2];
  std::vector<size_t> real, synthetic;
  bool synth = false;
  for (int i = 3; i < argc; ++i) {
    if (std::string(argv[i]) == "--synthetic") {
      synth = true;
      continue;
    }
    (synth ? synthetic : real).push_back(std::stoul(argv[i]));
  }
  if (real.empty() && synthetic.empty()) real = {8192, 32768};
  fs::create_directories(work);

  std::printf(
      "| context | cold TTFT s | warm TTFT s after restart | cold / warm | restored tokens | "
      "restore s |\n|---|---|---|---|---|---|\n");
  Chain largest;
  fs::path largest_dir;
  for (size_t n : real) {
    const fs::path dir = work / ("ctx-" + std::to_string(n));
    fs::remove_all(dir);
    const std::vector<int32_t> prompt = Tokens(n, 1);
    double cold;
    int64_t cached = 0;
    cache::KeyContext ctx;
    cache::BlockKey fingerprint;
    {
      auto store = Store(dir);
      auto e = Open(model, store);
      cold = TimeToFirstToken(*e, prompt, &cached);
      fingerprint = e->model_fingerprint();
    }
    bench::DropDirFromPageCache(dir);
    std::vector<int32_t> next = prompt;
    const std::vector<int32_t> more = Tokens(32, 2);
    next.insert(next.end(), more.begin(), more.end());
    auto store = Store(dir);
    auto e = Open(model, store);
    const double warm = TimeToFirstToken(*e, next, &cached);
    std::printf("| %zu | %.2f | %.3f | %.1fx | %lld | %.3f |\n", n, cold, warm, cold / warm,
                static_cast<long long>(cached), e->stats().cache_restore_seconds);
    std::fflush(stdout);
    ctx = cache::KeyContext{fingerprint, engine::Engine::kCacheFormat, "default",
                            engine::kCpuNumerics};
    if (prompt.size() > largest.keys.size() * 64) {
      largest = ChainOf(prompt, ctx);
      largest_dir = dir;
    }
  }

  for (size_t n : synthetic) {
    const fs::path dir = work / ("synthetic-" + std::to_string(n));
    fs::remove_all(dir);
    // Real blocks to copy: a 4096-token prefill, and the state at its end.
    std::vector<std::string> sample;
    std::string snapshot_template;
    cache::BlockKey fingerprint;
    {
      auto store = Store(dir / "sample");
      auto e = Open(model, store);
      int64_t c = 0;
      TimeToFirstToken(*e, Tokens(4096, 5), &c);
      fingerprint = e->model_fingerprint();
      store->Flush();
      const cache::KeyContext ctx{fingerprint, engine::Engine::kCacheFormat, "default",
                                  engine::kCpuNumerics};
      Chain ch = ChainOf(Tokens(4096, 5), ctx);
      std::vector<std::span<const int32_t>> spans(ch.tokens.begin(), ch.tokens.end());
      for (auto& p : store->ReadBlocks(ch.keys, spans)) sample.push_back(*p);
    }
    // Short of the context by a block, so that the next turn still fits the model's context.
    const std::vector<int32_t> prompt = Tokens(n - 64, 6);
    const cache::KeyContext ctx{fingerprint, engine::Engine::kCacheFormat, "default",
                                engine::kCpuNumerics};
    const Chain ch = ChainOf(prompt, ctx);
    {
      auto store = Store(dir, 0);
      for (size_t j = 0; j < ch.keys.size(); ++j) {
        store->Put(cache::BlockStore::Kind::kBlock, ch.keys[j],
                   j == 0 ? cache::BlockKey{} : ch.keys[j - 1], static_cast<uint32_t>(j + 1),
                   ch.tokens[j], sample[j % sample.size()]);
        if (j % 1024 == 1023) store->Flush();
      }
      store->Flush();
      // The state at the end: an engine resumes there from the blocks (exact replay), and its
      // prompt-end snapshot is what the warm run below finds.
      auto e = Open(model, store);
      int64_t c = 0;
      std::vector<int32_t> up_to(prompt.begin(), prompt.end());
      up_to.push_back(7);
      TimeToFirstToken(*e, up_to, &c);
    }
    bench::DropDirFromPageCache(dir);
    std::vector<int32_t> next = prompt;
    next.push_back(7);
    const std::vector<int32_t> more = Tokens(32, 2);
    next.insert(next.end(), more.begin(), more.end());
    auto store = Store(dir);
    auto e = Open(model, store);
    int64_t cached = 0;
    const double warm = TimeToFirstToken(*e, next, &cached);
    std::printf("| %zu (synthetic) | not run | %.3f | - | %lld | %.3f |\n", n, warm,
                static_cast<long long>(cached), e->stats().cache_restore_seconds);
    std::fflush(stdout);
    if (prompt.size() > largest.keys.size() * 64) {
      largest = ch;
      largest_dir = dir;
    }
  }

  if (!largest.keys.empty()) {
    // Compacted first, so that every block is in an SST file on disk (not replayed from the
    // write-ahead log into memory at open) and the directory holds what a long-lived cache does.
    {
      rocksdb::Options o;
      std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
      for (const char* n : {"default", "blocks", "snapshots", "meta"}) cfs.push_back({n, {}});
      std::vector<rocksdb::ColumnFamilyHandle*> hs;
      rocksdb::DB* db = nullptr;
      if (rocksdb::DB::Open(o, (largest_dir / "cache").string(), cfs, &hs, &db).ok()) {
        for (auto* h : hs) db->CompactRange(rocksdb::CompactRangeOptions(), h, nullptr, nullptr);
        for (auto* h : hs) db->DestroyColumnFamilyHandle(h);
        db->Close();
        delete db;
      }
    }
    const uint64_t dir_bytes = DirBytes(largest_dir / "cache");
    uint64_t largest_payload = 0;
    {
      auto st = Store(largest_dir, 0)->stats();
      largest_payload = st.disk_bytes - st.snapshot_bytes;
    }
    double direct = 0;
    const fs::path raw_file = largest_dir / "raw-read.bin";
    const double buffered =
        RawReadSpeed(raw_file, std::max<uint64_t>(dir_bytes, 256ull << 20), &direct);
    std::printf(
        "\nRestore of %zu blocks (%.1f MiB) from a cold page cache; sequential read of the same "
        "disk, 4 MiB: %.0f MB/s direct, %.0f MB/s buffered; CRC32C %s. This disk's speed moves "
        "between reads, so each row is divided by a direct read of the same disk just before "
        "it.\n\n| keys per call | calling threads | into | MB/s | direct read just before, "
        "MB/s | of direct | CPU s (user + system, %u cores) |\n|---|---|---|---|---|---|---|\n",
        largest.keys.size(), largest_payload / 1048576.0, direct / 1e6, buffered / 1e6,
        cache::Crc32cInHardware() ? "in hardware (SSE4.2)" : "by table",
        std::thread::hardware_concurrency());
    // The last rows are what the engine's loader does: the whole chain in one call, which
    // spreads MultiGets of 256 over 8 threads inside the store; the very last one as it is now,
    // each payload copied by its reading thread straight into KV block memory.
    struct Row {
      size_t batch;
      int threads;
      bool into_blocks;
    };
    const size_t all = largest.keys.size();
    for (const Row& row : std::vector<Row>{{64, 1, false},
                                           {256, 1, false},
                                           {256, 4, false},
                                           {all, 1, false},
                                           {all, 1, true},
                                           {all, 1, true},
                                           {all, 1, true}}) {
      // Direct where the disk allows it, else buffered; either way out of the page cache.
      bench::DropDirFromPageCache(largest_dir);
      double raw = bench::DirectReadSpeed({raw_file.string()});
      if (raw <= 0) raw = buffered;
      double cpu = 0;
      const double v =
          RestoreSpeed(largest_dir, largest, row.batch, row.threads, row.into_blocks, &cpu);
      std::printf("| %zu | %d | %s | %.0f | %.0f | %.0f%% | %.3f |\n", row.batch, row.threads,
                  row.into_blocks ? "KV block memory (ReadBlocksInto)" : "strings (ReadBlocks)",
                  v / 1e6, raw / 1e6, 100 * v / raw, cpu);
      std::fflush(stdout);
    }
    fs::remove(raw_file);
    auto store = Store(largest_dir, 0);
    std::vector<std::span<const int32_t>> first = {largest.tokens[0]};
    const double payload = store->ReadBlocks(std::span(largest.keys).first(1), first)[0]->size();
    const auto st = store->stats();
    store.reset();
    // Everything in the directory that is not a block's KV payload or a snapshot, per block.
    const double blocks = static_cast<double>(st.blocks);
    const double per_block = (dir_bytes - blocks * payload - st.snapshot_bytes) / blocks;
    const double tokens = blocks * 64;
    std::printf(
        "\nBytes per cached token (%.0f tokens): KV payload %.2f B; the compacted RocksDB "
        "directory %.2f B, of which snapshots %.2f B and everything else (headers, token "
        "ids, keys, meta rows, RocksDB's own) %.0f B per block: overhead %.2f%% without "
        "snapshots. For the released model's 56,960-byte blocks the same per-block bytes "
        "are %.2f%%.\n",
        tokens, payload / 64, dir_bytes / tokens, st.snapshot_bytes / tokens, per_block,
        100 * per_block / payload, 100 * per_block / 56960);
  }
  return 0;
}
