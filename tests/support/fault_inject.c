// An LD_PRELOAD library that makes file writes fail, for fault-injection tests of the real
// daemon: the block store (RocksDB) and the catalog (SQLite) see the errors a failing or full
// disk gives, through the same system calls they use.
//
// Configured by the environment when the library loads:
//   FLASHD_FAULT        enospc | eio | short | fsync   what goes wrong
//   FLASHD_FAULT_PATH   only files whose path contains this text (e.g. "/cache/", "catalog.db")
//   FLASHD_FAULT_AFTER  let this many matching calls succeed first (default 0)
//   FLASHD_FAULT_FILE   a file whose existence turns the faults on (absent: off), so a test can
//                       start the daemon healthy and then break its disk
// "short" makes every matching write write at most half its bytes (callers must loop); the
// others fail the call with ENOSPC or EIO, "fsync" only fsync and fdatasync.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static const char* mode;
static const char* path_part;
static const char* switch_file;
static long after;
static atomic_long seen;

__attribute__((constructor)) static void Init(void) {
  mode = getenv("FLASHD_FAULT");
  path_part = getenv("FLASHD_FAULT_PATH");
  switch_file = getenv("FLASHD_FAULT_FILE");
  const char* a = getenv("FLASHD_FAULT_AFTER");
  after = a ? atol(a) : 0;
}

// True when a call on `fd` should go wrong now.
static int Hit(int fd) {
  if (mode == NULL) return 0;
  if (switch_file != NULL && access(switch_file, F_OK) != 0) return 0;
  if (path_part != NULL) {
    char link[64], target[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    const ssize_t n = readlink(link, target, sizeof target - 1);
    if (n <= 0) return 0;
    target[n] = 0;
    if (strstr(target, path_part) == NULL) return 0;
  }
  return atomic_fetch_add(&seen, 1) >= after;
}

static int WriteFaults(void) { return mode != NULL && strcmp(mode, "fsync") != 0; }
static int FailWrites(void) { return strcmp(mode, "enospc") == 0 || strcmp(mode, "eio") == 0; }
static int Errno(void) { return strcmp(mode, "enospc") == 0 ? ENOSPC : EIO; }

typedef ssize_t (*WriteFn)(int, const void*, size_t);
typedef ssize_t (*PwriteFn)(int, const void*, size_t, off_t);
typedef ssize_t (*WritevFn)(int, const struct iovec*, int);
typedef int (*SyncFn)(int);
#define REAL(name, type)   \
  static type real_##name; \
  if (!real_##name) real_##name = (type)dlsym(RTLD_NEXT, #name)

ssize_t write(int fd, const void* buf, size_t n) {
  REAL(write, WriteFn);
  if (fd > 2 && WriteFaults() && Hit(fd)) {
    if (FailWrites()) {
      errno = Errno();
      return -1;
    }
    if (strcmp(mode, "short") == 0 && n > 1) n /= 2;
  }
  return real_write(fd, buf, n);
}

ssize_t pwrite64(int fd, const void* buf, size_t n, off_t off) {
  REAL(pwrite64, PwriteFn);
  if (WriteFaults() && Hit(fd)) {
    if (FailWrites()) {
      errno = Errno();
      return -1;
    }
    if (strcmp(mode, "short") == 0 && n > 1) n /= 2;
  }
  return real_pwrite64(fd, buf, n, off);
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t off) { return pwrite64(fd, buf, n, off); }

ssize_t writev(int fd, const struct iovec* iov, int count) {
  REAL(writev, WritevFn);
  if (fd > 2 && WriteFaults() && Hit(fd)) {
    if (FailWrites()) {
      errno = Errno();
      return -1;
    }
    if (strcmp(mode, "short") == 0 && count > 0) {
      struct iovec first = iov[0];
      if (first.iov_len > 1) first.iov_len /= 2;
      return real_writev(fd, &first, 1);
    }
  }
  return real_writev(fd, iov, count);
}

int fsync(int fd) {
  REAL(fsync, SyncFn);
  if (mode && strcmp(mode, "fsync") == 0 && Hit(fd)) {
    errno = EIO;
    return -1;
  }
  return real_fsync(fd);
}

int fdatasync(int fd) {
  REAL(fdatasync, SyncFn);
  if (mode && strcmp(mode, "fsync") == 0 && Hit(fd)) {
    errno = EIO;
    return -1;
  }
  return real_fdatasync(fd);
}
