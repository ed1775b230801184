// Loading a checkpoint: the model files read before serving (engine/model_files.h) on 1..N
// threads, and with SHA-256 checks, against the sequential direct read of the same files on the
// same disk, measured before and after each run (this disk's speed moves between reads); then
// the open and bind of every tensor (Model::Load).
//
//   build/bench/load_bench MODEL_DIR [THREADS...]
//
// Make a checkpoint of the released layout at scale with `flashd mkmodel --layers N` (see
// docs/benchmarks.md). Every run starts from a cold page cache: the files are dropped from it
// (posix_fadvise DONTNEED: containers may not write /proc/sys/vm/drop_caches).
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/disk.h"
#include "engine/model.h"
#include "engine/model_files.h"
#include "engine/safetensors.h"

using namespace flashd;
using Clock = std::chrono::steady_clock;

namespace {

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: load_bench MODEL_DIR [THREADS...]\n");
    return 2;
  }
  const std::string dir = argv[1];
  std::vector<int> threads;
  for (int i = 2; i < argc; ++i) threads.push_back(std::atoi(argv[i]));
  if (threads.empty()) threads = {1, 2, 4, 8, 16};
  auto files = engine::CheckpointFiles(dir);
  if (!files.ok()) {
    std::fprintf(stderr, "%s\n", files.status().ToString().c_str());
    return 1;
  }
  uint64_t total = 0;
  for (const std::string& f : *files) {
    FILE* fp = std::fopen(f.c_str(), "rb");
    if (fp == nullptr) continue;
    std::fseek(fp, 0, SEEK_END);
    total += static_cast<uint64_t>(std::ftell(fp));
    std::fclose(fp);
  }
  std::printf("%s: %zu files, %.2f GB\n\n", dir.c_str(), files->size(), total / 1e9);
  std::printf(
      "| read | threads | GB/s | direct read before / after, GB/s | of their mean |\n"
      "|---|---|---|---|---|\n");
  auto row = [&](const char* what, int n, bool sha) {
    bench::DropFromPageCache(*files);
    const double before = bench::DirectReadSpeed(*files);
    bench::DropFromPageCache(*files);
    engine::ReadFilesOptions o;
    o.threads = n;
    o.sha256 = sha;
    auto got = engine::ReadFiles(*files, o);
    if (!got.ok()) {
      std::fprintf(stderr, "%s\n", got.status().ToString().c_str());
      std::exit(1);
    }
    const double v = got->bytes / got->seconds;
    bench::DropFromPageCache(*files);
    const double after = bench::DirectReadSpeed(*files);
    const double direct = (before + after) / 2;
    std::printf("| %s | %d | %.2f | %.2f / %.2f | %.0f%% |\n", what, n, v / 1e9, before / 1e9,
                after / 1e9, 100 * v / direct);
    std::fflush(stdout);
  };
  for (int n : threads) row("into the page cache", n, false);
  row("with SHA-256 of every file", 8, true);
  // Opening and binding, the page cache now warm from the last read.
  const auto t = Clock::now();
  auto model = engine::Model::Load(dir);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  std::printf("\nModel::Load (map every shard, check and bind %zu tensors): %.3f s\n",
              (*model)->checkpoint().tensors().size(), Since(t));
  return 0;
}
