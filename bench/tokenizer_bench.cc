// Tokenizer encode speed on source code, single-threaded, in MB/s; and the time to tokenise a
// context of about a million tokens.
//
//   build/bench/tokenizer_bench TOKENIZER_JSON FILE...
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "engine/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: tokenizer_bench TOKENIZER_JSON FILE...\n");
    return 2;
  }
  auto tok = flashd::engine::Tokenizer::Load(argv[1]);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
    return 1;
  }
  std::string corpus;
  for (int i = 2; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    corpus += ss.str();
  }
  // Cold: a fresh piece cache for every pass would need a new tokenizer; the first pass is cold.
  auto start = std::chrono::steady_clock::now();
  size_t tokens = (*tok)->Encode(corpus).size();
  double cold = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  start = std::chrono::steady_clock::now();
  const int passes = 5;
  for (int p = 0; p < passes; ++p) tokens = (*tok)->Encode(corpus).size();
  double warm =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / passes;
  std::printf("corpus %.2f MB, %zu tokens (%.2f bytes/token)\n", corpus.size() / 1e6, tokens,
              double(corpus.size()) / tokens);
  std::printf("encode: first pass %.1f MB/s, later passes %.1f MB/s (one thread)\n",
              corpus.size() / 1e6 / cold, corpus.size() / 1e6 / warm);
  std::printf("a 1M-token context of this text: %.3f s\n", warm * 1e6 / tokens);
  return 0;
}
