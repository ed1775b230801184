// Reading a checkpoint's files before serving: every byte once, on several threads, so that the
// memory-mapped weights are in the page cache before the first request (instead of faulted in
// page by page during it), with progress, and optionally each file's SHA-256 checked against a
// SHA256SUMS file beside it (the `sha256sum` format: "<64 hex digits>  <file name>" per line).
// The bytes are brought in through a mapping (MADV_POPULATE_READ), never copied out.
//
// Without checksums the files are cut into chunks read by all threads at once (a checkpoint of
// one file loads as fast as one of many); with checksums each file is hashed in order by one
// thread, the files spread over the threads.
//
// Thread-safety: the functions are reentrant; `progress` is called from one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "config/status.h"

namespace flashd::engine {

struct ReadFilesOptions {
  int threads = 8;
  uint64_t chunk_bytes = 64ull << 20;
  bool sha256 = false;  // Compute each file's SHA-256 (FilesRead::sha256).
  // Bytes read so far and in all, at most every 200 ms and once at the end.
  std::function<void(uint64_t done, uint64_t total)> progress;
};

struct FilesRead {
  uint64_t bytes = 0;
  double seconds = 0;
  std::map<std::string, std::string> sha256;  // Path -> lowercase hex, with options.sha256.
};

StatusOr<FilesRead> ReadFiles(const std::vector<std::string>& paths,
                              const ReadFilesOptions& options);

// The checksums of `dir`/SHA256SUMS by file name; NotFound when there is no such file, DataLoss
// naming the line when a line is not "<64 hex>  <name>".
StatusOr<std::map<std::string, std::string>> ReadSha256Sums(const std::string& dir);

// Every weight file of `dir` (CheckpointFiles) read with its SHA-256 and compared with
// SHA256SUMS: Ok, or DataLoss listing every file that differs or has no checksum there.
Status VerifyModelFiles(const std::string& dir, const ReadFilesOptions& options,
                        FilesRead* read = nullptr);

}  // namespace flashd::engine
