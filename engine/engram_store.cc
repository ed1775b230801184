#include "engine/engram_store.h"

#include <fcntl.h>
#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>

namespace flashd::engine {
namespace {

constexpr uint64_t kBlock = 4096;  // O_DIRECT's alignment of offsets, lengths and buffers.

int OpenDirect(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  // A file system without O_DIRECT (tmpfs) is read through the page cache instead.
  return fd >= 0 ? fd : ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
}

}  // namespace

StatusOr<std::vector<EngramTableFile>> EngramTableFiles(const Checkpoint& checkpoint,
                                                        const ModelConfig& config) {
  std::vector<EngramTableFile> tables;
  for (int l : config.engram_layer_ids) {
    const std::string p = "layers." + std::to_string(l) + ".engram.embed.";
    const TensorView* rows = checkpoint.Find(p + "weight");
    const TensorView* scales = checkpoint.Find(p + "scale");
    if (rows == nullptr || scales == nullptr) return NotFound(p + "weight or scale");
    tables.push_back({*rows->file, rows->file_offset, scales->file_offset, *scales->file,
                      rows->shape[0], static_cast<int>(rows->shape[1]),
                      static_cast<int>(scales->shape[1])});
  }
  return tables;
}

struct EngramStore::Ring {
  io_uring ring;
};

StatusOr<std::unique_ptr<EngramStore>> EngramStore::Open(std::vector<EngramTableFile> tables,
                                                         uint64_t cache_bytes,
                                                         unsigned queue_depth) {
  std::unique_ptr<EngramStore> s(new EngramStore());
  s->depth_ = std::max(1u, queue_depth);
  for (const EngramTableFile& t : tables) {
    if (t.rows <= 0 || t.row_bytes <= 0 || t.scale_bytes <= 0) {
      return InvalidArgument("EngramStore: " + t.path + ": empty table");
    }
    const int rf = OpenDirect(t.path);
    const int sf = OpenDirect(t.scales_path.empty() ? t.path : t.scales_path);
    if (rf < 0 || sf < 0) {
      if (rf >= 0) ::close(rf);
      if (sf >= 0) ::close(sf);
      return IoError("EngramStore: cannot open " + t.path + ": " + std::strerror(errno));
    }
    s->row_fds_.push_back(rf);
    s->scale_fds_.push_back(sf);
    s->slot_bytes_ =
        std::max<size_t>(s->slot_bytes_, static_cast<size_t>(t.row_bytes + t.scale_bytes));
  }
  s->tables_ = std::move(tables);
  s->ring_ = std::make_unique<Ring>();
  if (const int r = io_uring_queue_init(s->depth_, &s->ring_->ring, 0); r != 0) {
    s->ring_.reset();
    return IoError(std::string("EngramStore: io_uring: ") + std::strerror(-r));
  }
  s->capacity_ = s->slot_bytes_ > 0 ? cache_bytes / s->slot_bytes_ : 0;
  s->slab_.resize(s->capacity_ * s->slot_bytes_);
  s->free_slots_.reserve(s->capacity_);
  for (size_t i = s->capacity_; i-- > 0;) s->free_slots_.push_back(static_cast<uint32_t>(i));
  return s;
}

EngramStore::~EngramStore() {
  if (ring_) io_uring_queue_exit(&ring_->ring);
  for (int fd : row_fds_) ::close(fd);
  for (int fd : scale_fds_) ::close(fd);
}

EngramStore::Stats EngramStore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void EngramStore::AddWait(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.wait_seconds += seconds;
}

Status EngramStore::ReadAll(std::vector<Request>& requests) {
  // Distinct aligned spans (fd, first block, blocks) -> a buffer; most spans are one block.
  struct Span {
    uint8_t* buf = nullptr;
    uint64_t offset = 0, bytes = 0;
    int fd = -1;
    uint64_t need = 0;  // Bytes from `offset` the requests need (a read may end at EOF after).
  };
  std::map<std::tuple<int, uint64_t, uint64_t>, size_t> index;
  std::vector<Span> spans;
  std::vector<size_t> span_of(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    const uint64_t first = r.offset / kBlock * kBlock;
    const uint64_t last = (r.offset + r.bytes + kBlock - 1) / kBlock * kBlock;
    auto [it, fresh] = index.emplace(std::make_tuple(r.fd, first, last - first), spans.size());
    if (fresh) spans.push_back({nullptr, first, last - first, r.fd, 0});
    span_of[i] = it->second;
    Span& sp = spans[it->second];
    sp.need = std::max(sp.need, r.offset + r.bytes - first);
  }
  Status status = Status::Ok();
  for (Span& sp : spans) {
    sp.buf = static_cast<uint8_t*>(std::aligned_alloc(kBlock, sp.bytes));
    if (sp.buf == nullptr) status = ResourceExhausted("EngramStore: no memory for reads");
  }
  const auto start = std::chrono::steady_clock::now();
  io_uring* ring = &ring_->ring;
  size_t next = 0, inflight = 0;
  while (status.ok() && (next < spans.size() || inflight > 0)) {
    while (next < spans.size() && inflight < depth_) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring);
      if (sqe == nullptr) break;
      io_uring_prep_read(sqe, spans[next].fd, spans[next].buf,
                         static_cast<unsigned>(spans[next].bytes),
                         static_cast<off_t>(spans[next].offset));
      io_uring_sqe_set_data64(sqe, next);
      ++next;
      ++inflight;
    }
    io_uring_submit(ring);
    io_uring_cqe* cqe = nullptr;
    if (const int r = io_uring_wait_cqe(ring, &cqe); r != 0) {
      status = IoError(std::string("EngramStore: io_uring wait: ") + std::strerror(-r));
      break;
    }
    const Span& sp = spans[io_uring_cqe_get_data64(cqe)];
    // A read may end early only at the end of the file, past what the requests need.
    if (cqe->res < 0) {
      status = IoError(std::string("EngramStore: read failed: ") + std::strerror(-cqe->res));
    } else if (static_cast<uint64_t>(cqe->res) < sp.need) {
      status = DataLoss("EngramStore: short read (a truncated table file?)");
    }
    io_uring_cqe_seen(ring, cqe);
    --inflight;
  }
  // Whatever is still in flight after a failure is waited for before its buffer is freed.
  while (inflight > 0) {
    io_uring_cqe* cqe = nullptr;
    if (io_uring_wait_cqe(ring, &cqe) != 0) break;
    io_uring_cqe_seen(ring, cqe);
    --inflight;
  }
  stats_.read_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats_.reads += spans.size();
  for (const Span& sp : spans) stats_.read_bytes += sp.bytes;
  if (status.ok()) {
    for (size_t i = 0; i < requests.size(); ++i) {
      const Span& sp = spans[span_of[i]];
      std::memcpy(requests[i].out, sp.buf + (requests[i].offset - sp.offset), requests[i].bytes);
    }
  }
  for (Span& sp : spans) std::free(sp.buf);
  return status;
}

Status EngramStore::Gather(int t, const int64_t* ids, size_t n, uint8_t* rows_out,
                           uint8_t* scales_out) {
  if (t < 0 || t >= tables()) return InvalidArgument("EngramStore: no table " + std::to_string(t));
  const EngramTableFile& table = tables_[static_cast<size_t>(t)];
  const size_t rb = static_cast<size_t>(table.row_bytes),
               sb = static_cast<size_t>(table.scale_bytes);
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= table.rows) {
      return InvalidArgument("EngramStore: row " + std::to_string(ids[i]) + " is outside table " +
                             std::to_string(t) + " (" + std::to_string(table.rows) + " rows)");
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  stats_.gathers += 1;
  stats_.rows += n;
  auto key_of = [&](int64_t id) {
    return (static_cast<uint64_t>(t) << 48) | static_cast<uint64_t>(id);
  };
  // Hits copied now; each distinct missed id read once, its first position the one read into.
  std::unordered_map<int64_t, size_t> first;  // Missed id -> position read into.
  std::vector<Request> requests;
  std::vector<size_t> repeats;  // Positions whose id another position reads.
  for (size_t i = 0; i < n; ++i) {
    auto hit = cache_.find(key_of(ids[i]));
    if (hit != cache_.end()) {
      const uint8_t* slot = slab_.data() + hit->second.slot * slot_bytes_;
      std::memcpy(rows_out + i * rb, slot, rb);
      std::memcpy(scales_out + i * sb, slot + rb, sb);
      lru_.splice(lru_.begin(), lru_, hit->second.at);
      stats_.hits += 1;
      continue;
    }
    auto [it, fresh] = first.emplace(ids[i], i);
    if (!fresh) {
      repeats.push_back(i);
      stats_.hits += 1;
      continue;
    }
    const uint64_t id = static_cast<uint64_t>(ids[i]);
    requests.push_back({row_fds_[static_cast<size_t>(t)], table.rows_offset + id * rb,
                        static_cast<uint32_t>(rb), rows_out + i * rb});
    requests.push_back({scale_fds_[static_cast<size_t>(t)], table.scales_offset + id * sb,
                        static_cast<uint32_t>(sb), scales_out + i * sb});
  }
  if (!requests.empty()) FLASHD_RETURN_IF_ERROR(ReadAll(requests));
  for (size_t i : repeats) {
    const size_t from = first.at(ids[i]);
    std::memcpy(rows_out + i * rb, rows_out + from * rb, rb);
    std::memcpy(scales_out + i * sb, scales_out + from * sb, sb);
  }
  // The rows read join the cache, the least recently used leaving.
  for (const auto& [id, at] : first) {
    if (capacity_ == 0) break;
    uint32_t slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
    } else {
      auto old = cache_.find(lru_.back());
      slot = old->second.slot;
      cache_.erase(old);
      lru_.pop_back();
    }
    uint8_t* p = slab_.data() + slot * slot_bytes_;
    std::memcpy(p, rows_out + at * rb, rb);
    std::memcpy(p + rb, scales_out + at * sb, sb);
    lru_.push_front(key_of(id));
    cache_[key_of(id)] = {slot, lru_.begin()};
  }
  return Status::Ok();
}

}  // namespace flashd::engine
