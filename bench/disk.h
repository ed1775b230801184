// What the benchmarks that compare against the disk share: dropping files from the page cache
// (posix_fadvise DONTNEED after fdatasync: containers may not write /proc/sys/vm/drop_caches)
// and the disk's own sequential speed (O_DIRECT, 4 MiB reads, as `dd iflag=direct bs=4M`).
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace flashd::bench {

inline void DropFromPageCache(const std::vector<std::string>& files) {
  for (const std::string& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// Every regular file under `dir`.
inline void DropDirFromPageCache(const std::filesystem::path& dir) {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) files.push_back(e.path().string());
  }
  DropFromPageCache(files);
}

// Bytes per second reading `files` one after another with O_DIRECT; 0 where O_DIRECT is
// refused for all of them.
inline double DirectReadSpeed(const std::vector<std::string>& files) {
  void* buf = std::aligned_alloc(4096, 4 << 20);
  uint64_t total = 0;
  const auto t = std::chrono::steady_clock::now();
  for (const std::string& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_DIRECT);
    if (fd < 0) continue;
    for (ssize_t n; (n = ::read(fd, buf, 4 << 20)) > 0;) total += static_cast<uint64_t>(n);
    ::close(fd);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  std::free(buf);
  return total > 0 ? total / s : 0;
}

}  // namespace flashd::bench
