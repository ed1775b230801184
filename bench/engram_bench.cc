// What an SSD tier for the Engram tables (the released model's ~197 GB of n-gram rows) would have
// to serve, measured: the rows real text reads under the released config (the DeepSeek V4
// tokenizer, its compressed vocabulary, the released hashing), how many of them an in-memory
// cache of hot rows of each size holds (LRU, hit rate), and this disk's random 4 KiB reads with
// io_uring and O_DIRECT at several queue depths (the reads a missed row costs). The rows per
// second the disk can give, against the rows a token needs at each hit rate, bound the prefill
// speed such a tier allows.
//
//   build/bench/engram_bench TOKENIZER_DIR MODEL_DIR TEXT_FILE...
//
// MODEL_DIR: a checkpoint with an Engram table (`flashd mkmodel --layers 2`, whose layer 1 has
// one) on the disk to measure: its table's file is read at random, then the EngramStore
// (engine/engram_store.h) gathers rows from it with its cache off, the calls sized like a
// decode step and a prefill chunk: rows per second against the raw reads, and each call's time.
#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <list>
#include <random>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine/engram.h"
#include "engine/engram_store.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "engine/tiny_model.h"
#include "engine/tokenizer.h"

using namespace flashd;
using Clock = std::chrono::steady_clock;

namespace {

// Hit rate of an LRU cache of `capacity` rows over the row reads `rows`.
double LruHitRate(const std::vector<int64_t>& rows, size_t capacity) {
  std::list<int64_t> order;
  std::unordered_map<int64_t, std::list<int64_t>::iterator> where;
  where.reserve(capacity * 2);
  uint64_t hits = 0;
  for (int64_t r : rows) {
    auto it = where.find(r);
    if (it != where.end()) {
      ++hits;
      order.splice(order.begin(), order, it->second);
      continue;
    }
    order.push_front(r);
    where[r] = order.begin();
    if (order.size() > capacity) {
      where.erase(order.back());
      order.pop_back();
    }
  }
  return rows.empty() ? 0 : static_cast<double>(hits) / static_cast<double>(rows.size());
}

// Random 4 KiB O_DIRECT reads of `path` for `seconds` at queue depth `depth`: reads per second.
double RandomReads(const std::string& path, unsigned depth, double seconds) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  if (fd < 0) return 0;
  const off_t size = ::lseek(fd, 0, SEEK_END);
  const uint64_t blocks = static_cast<uint64_t>(size) / 4096;
  io_uring ring;
  if (io_uring_queue_init(depth, &ring, 0) != 0) {
    ::close(fd);
    return 0;
  }
  std::vector<void*> bufs(depth);
  for (auto& b : bufs) b = std::aligned_alloc(4096, 4096);
  std::mt19937_64 rng(7);
  auto submit = [&](unsigned slot) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    io_uring_prep_read(sqe, fd, bufs[slot], 4096, static_cast<off_t>((rng() % blocks) * 4096));
    io_uring_sqe_set_data64(sqe, slot);
  };
  for (unsigned i = 0; i < depth; ++i) submit(i);
  io_uring_submit(&ring);
  uint64_t done = 0;
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration<double>(seconds);
  while (Clock::now() < end) {
    io_uring_cqe* cqe = nullptr;
    if (io_uring_wait_cqe(&ring, &cqe) != 0) break;
    const unsigned slot = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
    if (cqe->res == 4096) ++done;
    io_uring_cqe_seen(&ring, cqe);
    submit(slot);
    io_uring_submit(&ring);
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  // Drain what is still in flight.
  for (unsigned i = 0; i < depth; ++i) {
    io_uring_cqe* cqe = nullptr;
    if (io_uring_wait_cqe(&ring, &cqe) != 0) break;
    io_uring_cqe_seen(&ring, cqe);
  }
  io_uring_queue_exit(&ring);
  for (auto& b : bufs) std::free(b);
  ::close(fd);
  return done / elapsed;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: engram_bench TOKENIZER_DIR MODEL_DIR TEXT_FILE...\n");
    return 2;
  }
  const std::string tokenizer_json = std::string(argv[1]) + "/tokenizer.json";
  auto tokenizer = engine::Tokenizer::Load(tokenizer_json);
  auto vocab = engine::BuildCompressedVocab(tokenizer_json);
  auto config = engine::ParseModelConfig(engine::ReleasedConfigText(), "released config");
  if (!tokenizer.ok() || !vocab.ok() || !config.ok()) {
    std::fprintf(stderr, "cannot load the tokenizer or the released config\n");
    return 1;
  }
  if (vocab->classes != config->engram_compressed_vocab_size) {
    std::fprintf(stderr, "the tokenizer gives %lld classes, the released config %lld\n",
                 static_cast<long long>(vocab->classes),
                 static_cast<long long>(config->engram_compressed_vocab_size));
    return 1;
  }
  engine::EngramHasher hasher(*config, std::move(*vocab));
  const int layers = static_cast<int>(config->engram_layer_ids.size());
  const int per_position = layers * hasher.columns();
  int64_t table_rows = 0;
  for (int64_t n : config->engram_num_embeddings) table_rows += n;
  // Row reads of the text, every file a sequence of its own; ids made unique across layers.
  std::vector<int64_t> rows;
  size_t tokens = 0;
  for (int i = 3; i < argc; ++i) {
    std::ifstream in(argv[i]);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::vector<int32_t> ids = (*tokenizer)->Encode(ss.str());
    std::vector<int32_t> classes;
    std::vector<int64_t> out(static_cast<size_t>(per_position));
    for (int32_t t : ids) {
      classes.push_back(hasher.ClassOf(t));
      const int count = std::min<int>(static_cast<int>(classes.size()), hasher.history() + 1);
      hasher.Hash(classes.data() + classes.size() - count, count, out.data());
      for (int l = 0; l < layers; ++l) {
        const int64_t base = l == 0 ? 0 : config->engram_num_embeddings[0];
        for (int c = 0; c < hasher.columns(); ++c)
          rows.push_back(base + out[l * hasher.columns() + c]);
      }
    }
    tokens += ids.size();
  }
  std::unordered_set<int64_t> distinct(rows.begin(), rows.end());
  const double row_bytes = config->engram_head_dim + config->engram_head_dim / 32.0;
  std::printf(
      "Text: %d files, %zu tokens, %zu row reads (%d per token), %zu distinct rows (%.1f%%) of "
      "the released tables' %lld rows (%.0f bytes each with its scales)\n\n",
      argc - 3, tokens, rows.size(), per_position, distinct.size(),
      100.0 * distinct.size() / rows.size(), static_cast<long long>(table_rows), row_bytes);
  std::printf(
      "| hot-row cache, rows | of the tables | memory | hit rate (LRU) |\n|---|---|---|---|\n");
  for (size_t cap :
       {size_t{1} << 16, size_t{1} << 18, size_t{1} << 20, size_t{1} << 22, size_t{1} << 24}) {
    std::printf("| %zu | %.3f%% | %.2f GB | %.1f%% |\n", cap, 100.0 * cap / table_rows,
                cap * row_bytes / 1e9, 100 * LruHitRate(rows, cap));
  }
  auto cp = engine::Checkpoint::Open(argv[2]);
  if (!cp.ok()) {
    std::fprintf(stderr, "%s\n", cp.status().ToString().c_str());
    return 1;
  }
  auto model_config = engine::LoadModelConfig(argv[2]);
  auto tables = model_config.ok()
                    ? engine::EngramTableFiles(**cp, *model_config)
                    : StatusOr<std::vector<engine::EngramTableFile>>(model_config.status());
  if (!tables.ok() || tables->empty()) {
    std::fprintf(stderr, "%s has no Engram table\n", argv[2]);
    return 1;
  }
  const engine::EngramTableFile table = tables->front();
  std::printf("\nRandom 4 KiB reads of %s, O_DIRECT, io_uring:\n\n", table.path.c_str());
  std::printf("| queue depth | reads/s | MB/s |\n|---|---|---|\n");
  double best = 0;
  for (unsigned depth : {1u, 8u, 32u, 128u}) {
    const double iops = RandomReads(table.path, depth, 3.0);
    best = std::max(best, iops);
    std::printf("| %u | %.0f | %.1f |\n", depth, iops, iops * 4096 / 1e6);
  }
  // The store on that table, its cache off: every row a miss.
  auto store = engine::EngramStore::Open({table}, 0, 128);
  if (!store.ok()) {
    std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
    return 1;
  }
  std::printf("\nEngramStore::Gather on that table (%lld rows), cache off, random rows:\n\n",
              static_cast<long long>(table.rows));
  std::printf(
      "| rows per call (one Engram layer of) | calls | ms per call | rows/s | disk reads/s | of "
      "the raw reads/s at the best depth |\n|---|---|---|---|---|---|\n");
  std::mt19937_64 rng(11);
  struct Shape {
    const char* what;
    size_t rows;
    int calls;
  };
  const size_t columns = static_cast<size_t>(hasher.columns());
  for (const Shape& sh : std::vector<Shape>{{"a decode step of 1 sequence", columns, 400},
                                            {"a decode step of 32", 32 * columns, 40},
                                            {"a prefill chunk of 512 tokens", 512 * columns, 8}}) {
    std::vector<int64_t> ids(sh.rows);
    std::vector<uint8_t> out(sh.rows * static_cast<size_t>(table.row_bytes));
    std::vector<uint8_t> scales(sh.rows * static_cast<size_t>(table.scale_bytes));
    const auto before = (*store)->stats();
    const auto t = Clock::now();
    for (int c = 0; c < sh.calls; ++c) {
      for (int64_t& id : ids) id = static_cast<int64_t>(rng() % static_cast<uint64_t>(table.rows));
      const Status st = (*store)->Gather(0, ids.data(), ids.size(), out.data(), scales.data());
      if (!st.ok()) {
        std::fprintf(stderr, "%s\n", st.ToString().c_str());
        return 1;
      }
    }
    const double s = std::chrono::duration<double>(Clock::now() - t).count();
    const auto after = (*store)->stats();
    const double reads = static_cast<double>(after.reads - before.reads) / s;
    std::printf("| %zu (%s) | %d | %.3f | %.0f | %.0f | %.0f%% |\n", sh.rows, sh.what, sh.calls,
                1000 * s / sh.calls, static_cast<double>(sh.rows) * sh.calls / s, reads,
                100 * reads / best);
  }
  return 0;
}
