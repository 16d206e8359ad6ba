// Shared-memory slot ring: segment lifetime and the slot protocol described in staging_ring.h. No torch here.
#include "staging_ring.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PIPEMORPH_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define PIPEMORPH_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define PIPEMORPH_CPU_RELAX() ((void)0)
#endif

namespace pipemorph {
namespace staging {

namespace {

using Clock = std::chrono::steady_clock;

std::string shm_name(const std::string& name) {
  std::string n = name.empty() || name[0] != '/' ? "/" + name : name;
  if (n.size() < 2 || n.size() > 250 || n.find('/', 1) != std::string::npos) {
    throw std::invalid_argument("staging ring name '" + name +
                                "' is not usable: give 1-249 characters without '/' (a POSIX shm name)");
  }
  return n;
}

std::string errno_text(int err) { return std::string(std::strerror(err)); }

uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

std::string fmt_seconds(double s) {
  std::ostringstream o;
  o.precision(3);
  o << s << " s";
  return o.str();
}

// Shared (not FUTEX_PRIVATE) futex on a word of the MAP_SHARED segment: the kernel keys it by the page, so the
// two processes meet on it whatever their virtual addresses.
long futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

// Length of the spin phase of a wait: $PIPEMORPH_STAGING_SPIN_US (read once), default 20 us.
std::chrono::microseconds spin_phase() {
  static const std::chrono::microseconds us{[] {
    const char* v = std::getenv("PIPEMORPH_STAGING_SPIN_US");
    const long n = v ? std::strtol(v, nullptr, 10) : 20;
    return std::clamp(n, 0L, 10000L);
  }()};
  return us;
}

// For attach() only (waiting for another process to create a segment): spin briefly, then sleep 10 us
// doubling to 1 ms.
class Backoff {
 public:
  void pause() {
    ++n_;
    if (n_ < 2000) {
      PIPEMORPH_CPU_RELAX();
    } else if (n_ < 2010) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
      if (sleep_us_ < 1000) sleep_us_ *= 2;
    }
  }

 private:
  uint64_t n_ = 0;
  int sleep_us_ = 10;
};

}  // namespace

const char* state_name(uint32_t s) {
  switch (s) {
    case EMPTY: return "EMPTY";
    case WRITING: return "WRITING (the producer's copy has not completed)";
    case FULL: return "FULL (the consumer has not popped it)";
    case READING: return "READING (the consumer's copy has not completed)";
    default: return "CORRUPT";
  }
}

Ring::Ring(std::string name, void* base, uint64_t size)
    : name_(std::move(name)), base_(base), size_(size), hdr_(static_cast<RingHeader*>(base)) {}

Ring::~Ring() { close(); }

void Ring::close() {
  if (base_ != nullptr) {
    if (before_unmap_) {
      try {
        before_unmap_(base_, size_);
      } catch (...) {
        // close() runs in destructors: never throw. The mapping goes away regardless.
      }
      before_unmap_ = nullptr;
    }
    munmap(base_, size_);
    base_ = nullptr;
    hdr_ = nullptr;
  }
}

Ring* Ring::create(const std::string& name, uint32_t num_slots, uint64_t slot_capacity) {
  const std::string n = shm_name(name);
  if (num_slots < 1 || num_slots > 4096) {
    throw std::invalid_argument("staging ring '" + n + "': num_slots must be in 1..4096, got " +
                                std::to_string(num_slots));
  }
  if (slot_capacity < 1) throw std::invalid_argument("staging ring '" + n + "': slot capacity must be >= 1 byte");
  const uint64_t data_offset = round_up(kPage + uint64_t(num_slots) * sizeof(SlotHeader), kPage);
  const uint64_t stride = round_up(slot_capacity, kPage);
  const uint64_t total = data_offset + uint64_t(num_slots) * stride;

  int fd = shm_open(n.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    int err = errno;
    throw std::runtime_error("cannot create staging ring '" + n + "': " + errno_text(err) +
                             (err == EEXIST ? " (a ring of that name exists; unlink it or pick another name)" : ""));
  }
  // Size it without touching its pages: zeroing tens of MiB here (posix_fallocate, MAP_POPULATE) took
  // 0.1-1.5 s on a loaded host, at an iteration boundary. The attaching delegate populates them, off
  // the training thread (nor do its delegate: an idle queue's pages are never allocated). A /dev/shm without room for the ring is refused here (statvfs) rather than
  // with SIGBUS at the first push (a race with other users of /dev/shm remains).
  int rc = ftruncate(fd, off_t(total)) == 0 ? 0 : errno;
  struct statvfs fs;
  if (rc == 0 && fstatvfs(fd, &fs) == 0 && uint64_t(fs.f_bavail) * fs.f_frsize < total) rc = ENOSPC;
  if (rc != 0) {
    ::close(fd);
    shm_unlink(n.c_str());
    throw NoRoomError("cannot size staging ring '" + n + "' to " + std::to_string(total) +
                             " bytes: " + errno_text(rc) + " (is /dev/shm large enough?)");
  }
  void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(n.c_str());
    throw std::runtime_error("cannot map staging ring '" + n + "': " + errno_text(err));
  }
  // The segment is zero-filled by the kernel; construct the atomics in place, then publish the magic last.
  auto* hdr = new (base) RingHeader();
  hdr->layout_version = kLayoutVersion;
  hdr->num_slots = num_slots;
  hdr->slot_capacity = slot_capacity;
  hdr->slot_stride = stride;
  hdr->data_offset = data_offset;
  hdr->total_bytes = total;
  hdr->head.store(0, std::memory_order_relaxed);
  hdr->tail.store(0, std::memory_order_relaxed);
  for (uint32_t i = 0; i < num_slots; ++i) {
    auto* s = new (static_cast<char*>(base) + kPage + i * sizeof(SlotHeader)) SlotHeader();
    s->state.store(EMPTY, std::memory_order_relaxed);
    s->waiters.store(0, std::memory_order_relaxed);
  }
  // Release: an attacher whose acquire load sees kMagic also sees every field written above.
  hdr->magic.store(kMagic, std::memory_order_release);
  return new Ring(n, base, total);
}

Ring* Ring::attach(const std::string& name, double timeout_s) {
  const std::string n = shm_name(name);
  const auto start = Clock::now();
  Backoff backoff;
  std::string why;
  while (true) {
    int fd = shm_open(n.c_str(), O_RDWR, 0);
    if (fd < 0) {
      why = errno == ENOENT ? "it does not exist" : errno_text(errno);
    } else {
      struct stat st;
      if (fstat(fd, &st) == 0 && uint64_t(st.st_size) >= kPage) {
        // Map the header page first to learn the size, then the whole segment.
        void* p = mmap(nullptr, kPage, PROT_READ, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) {
          auto* h = static_cast<RingHeader*>(p);
          const bool ready = h->magic.load(std::memory_order_acquire) == kMagic;
          const uint32_t version = h->layout_version;
          const uint64_t total = h->total_bytes;
          munmap(p, kPage);
          if (ready && version != kLayoutVersion) {
            ::close(fd);
            throw std::runtime_error("staging ring '" + n + "' has layout version " + std::to_string(version) +
                                     ", this build reads version " + std::to_string(kLayoutVersion));
          }
          if (ready && uint64_t(st.st_size) >= total) {
            void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);  // pages on first use
            int err = errno;
            ::close(fd);
            if (base == MAP_FAILED) {
              throw std::runtime_error("cannot map staging ring '" + n + "': " + errno_text(err));
            }
            return new Ring(n, base, total);
          }
        }
      }
      ::close(fd);
      why = "its creator has not finished initialising it";
    }
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (waited >= timeout_s) {
      throw TimeoutError("cannot attach staging ring '" + n + "' after " + fmt_seconds(waited) + ": " + why);
    }
    backoff.pause();
  }
}

bool Ring::unlink_name(const std::string& name) {
  const std::string n = shm_name(name);
  if (shm_unlink(n.c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  throw std::runtime_error("cannot unlink staging ring '" + n + "': " + errno_text(errno));
}

void Ring::check_open(const char* what) const {
  if (base_ == nullptr) throw std::runtime_error(std::string("cannot ") + what + " on closed staging ring '" + name_ + "'");
}

SlotHeader* Ring::slot_header(uint32_t i) const {
  return reinterpret_cast<SlotHeader*>(static_cast<char*>(base_) + kPage + uint64_t(i) * sizeof(SlotHeader));
}

void* Ring::payload(uint32_t i) const {
  return static_cast<char*>(base_) + hdr_->data_offset + uint64_t(i) * hdr_->slot_stride;
}

Slot Ring::make_slot(uint32_t i, uint64_t seq) const {
  SlotHeader* s = slot_header(i);
  return Slot{i, seq, &s->meta, payload(i), s};
}

uint32_t Ring::num_slots() const { check_open("query num_slots"); return hdr_->num_slots; }
uint64_t Ring::slot_capacity() const { check_open("query slot_capacity"); return hdr_->slot_capacity; }
uint64_t Ring::head() const { check_open("query head"); return hdr_->head.load(std::memory_order_relaxed); }
uint64_t Ring::tail() const { check_open("query tail"); return hdr_->tail.load(std::memory_order_relaxed); }
uint64_t Ring::occupancy() const {
  check_open("query occupancy");
  // Read tail first: head only grows, so head - tail cannot underflow.
  const uint64_t t = hdr_->tail.load(std::memory_order_relaxed);
  const uint64_t h = hdr_->head.load(std::memory_order_relaxed);
  return h >= t ? h - t : 0;
}

void Ring::store_and_wake(SlotHeader* slot, uint32_t value) {
  slot->state.store(value, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // Dekker with the waiter: see staging_ring.h
  if (slot->waiters.load(std::memory_order_relaxed) != 0) futex(&slot->state, FUTEX_WAKE, INT_MAX, nullptr);
}

bool Ring::wait_state(uint32_t i, uint32_t want, double timeout_s, const PollFn& poll) const {
  SlotHeader* h = slot_header(i);
  // Acquire: pairs with the release store that set `want` (see staging_ring.h).
  if (h->state.load(std::memory_order_acquire) == want) return true;
  const auto start = Clock::now();
  const auto deadline = timeout_s < 0 ? Clock::time_point::max()
                                      : start + std::chrono::duration_cast<Clock::duration>(
                                                    std::chrono::duration<double>(timeout_s));
  // Phase 1: spin ~20 us; a message that is about to arrive then costs no syscall.
  const auto spin_until = start + spin_phase();
  for (uint32_t k = 1;; ++k) {
    PIPEMORPH_CPU_RELAX();
    if (h->state.load(std::memory_order_acquire) == want) return true;
    if ((k & 63) == 0 && Clock::now() >= spin_until) break;
  }
  // Phase 2: sleep on the futex, in pieces of at most 100 ms (timeout and poll checks).
  h->waiters.fetch_add(1, std::memory_order_seq_cst);
  struct Unregister {
    SlotHeader* h;
    ~Unregister() { h->waiters.fetch_sub(1, std::memory_order_relaxed); }
  } unregister{h};
  auto next_poll = start + std::chrono::milliseconds(100);
  while (true) {
    // seq_cst (so also acquire): the other half of the Dekker pair with store_and_wake.
    const uint32_t cur = h->state.load(std::memory_order_seq_cst);
    if (cur == want) return true;
    auto now = Clock::now();
    if (now >= deadline) return false;
    if (poll && now >= next_poll) {
      poll();
      now = Clock::now();
      next_poll = now + std::chrono::milliseconds(100);
    }
    const auto wake = std::min(deadline, next_poll);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(wake - now).count();
    if (ns <= 0) continue;
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    // Returns on FUTEX_WAKE, when the state no longer equals `cur` (EAGAIN), on timeout or on a signal.
    futex(&h->state, FUTEX_WAIT, cur, &ts);
  }
}

Slot Ring::claim_write(uint64_t nbytes, double timeout_s, const PollFn& poll) {
  check_open("push");
  if (nbytes > hdr_->slot_capacity) {
    throw std::length_error("cannot push " + std::to_string(nbytes) + " bytes into staging ring '" + name_ +
                            "': a slot holds at most " + std::to_string(hdr_->slot_capacity) +
                            " bytes (create the ring with a larger slot capacity)");
  }
  const uint64_t seq = hdr_->head.load(std::memory_order_relaxed);  // only this producer writes head
  const uint32_t i = uint32_t(seq % hdr_->num_slots);
  if (!wait_state(i, EMPTY, timeout_s, poll)) {
    throw TimeoutError("timed out after " + fmt_seconds(timeout_s) + " waiting for a free slot in staging ring '" +
                       name_ + "': slot " + std::to_string(i) + " of " + std::to_string(hdr_->num_slots) +
                       " is still " + state_name(slot_header(i)->state.load(std::memory_order_relaxed)) +
                       "; message " + std::to_string(seq) + " was not pushed");
  }
  Slot s = make_slot(i, seq);
  s.header->state.store(WRITING, std::memory_order_relaxed);  // only the producer looks at WRITING; no ordering needed
  s.meta->seq = seq;
  s.meta->nbytes = nbytes;
  hdr_->head.store(seq + 1, std::memory_order_relaxed);
  return s;
}

bool Ring::wait_readable(double timeout_s, const PollFn& poll, bool throw_on_timeout, Slot* out) {
  check_open("pop");
  const uint64_t seq = hdr_->tail.load(std::memory_order_relaxed);  // only this consumer writes tail
  const uint32_t i = uint32_t(seq % hdr_->num_slots);
  if (!wait_state(i, FULL, timeout_s, poll)) {
    if (!throw_on_timeout) return false;
    throw TimeoutError("timed out after " + fmt_seconds(timeout_s) + " waiting for message " + std::to_string(seq) +
                       " in staging ring '" + name_ + "': slot " + std::to_string(i) + " of " +
                       std::to_string(hdr_->num_slots) + " is still " +
                       state_name(slot_header(i)->state.load(std::memory_order_relaxed)));
  }
  Slot s = make_slot(i, seq);
  if (s.meta->seq != seq) {
    throw std::runtime_error("staging ring '" + name_ + "' is corrupt: slot " + std::to_string(i) + " holds message " +
                             std::to_string(s.meta->seq) + " where message " + std::to_string(seq) +
                             " was expected (more than one producer or consumer?)");
  }
  *out = s;
  return true;
}

void Ring::claim_read(const Slot& slot) {
  slot.header->state.store(READING, std::memory_order_relaxed);  // the producer waits for EMPTY, READING needs no order
  hdr_->tail.store(slot.seq + 1, std::memory_order_relaxed);
}

Slot Ring::claimed(uint64_t seq, uint32_t want) const {
  check_open(want == WRITING ? "finish a write" : "finish a read");
  const uint32_t i = uint32_t(seq % hdr_->num_slots);
  SlotHeader* h = slot_header(i);
  const uint32_t state = h->state.load(std::memory_order_relaxed);  // our own earlier store: no ordering needed
  if (state != want || h->meta.seq != seq) {
    throw std::runtime_error("staging ring '" + name_ + "': message " + std::to_string(seq) + " is not " +
                             (want == WRITING ? "being written" : "being read") + " by this process (slot " +
                             std::to_string(i) + " is " + state_name(state) + ", holding message " +
                             std::to_string(h->meta.seq) + ")");
  }
  return make_slot(i, seq);
}

void Ring::abort_write(const Slot& slot) {
  if (hdr_->head.load(std::memory_order_relaxed) != slot.seq + 1) {
    throw std::runtime_error("staging ring '" + name_ + "': cannot abort message " + std::to_string(slot.seq) +
                             ": later messages were claimed after it");
  }
  hdr_->head.store(slot.seq, std::memory_order_relaxed);
  slot.header->state.store(EMPTY, std::memory_order_relaxed);  // nothing was written: nothing to order
}

void Ring::abort_read(const Slot& slot) {
  if (hdr_->tail.load(std::memory_order_relaxed) != slot.seq + 1) {
    throw std::runtime_error("staging ring '" + name_ + "': cannot put message " + std::to_string(slot.seq) +
                             " back: later messages were claimed after it");
  }
  hdr_->tail.store(slot.seq, std::memory_order_relaxed);
  slot.header->state.store(FULL, std::memory_order_relaxed);  // nothing was read; the payload is unchanged
}

}  // namespace staging
}  // namespace pipemorph
