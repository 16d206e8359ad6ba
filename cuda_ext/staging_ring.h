// Host-staging slot ring shared by two processes (PipeMorph §5.2, "CPU-based communication delegation").
//
// One POSIX shared-memory segment holds a RingHeader, K SlotHeaders and K payload areas of a fixed capacity.
// A ring has exactly ONE producer and ONE consumer (the training process and one delegate process); several
// queues are several rings. Messages leave in the order they entered (FIFO).
//
// Segment layout (all offsets page aligned so the payloads can be registered / DMA'd by CUDA):
//   [0, 4096)                       RingHeader
//   [4096, data_offset)             K x SlotHeader (256 bytes each)
//   data_offset + i * slot_stride   payload of slot i, slot_capacity bytes usable
//
// Slot protocol (state word of slot i, std::atomic<uint32_t> in shared memory):
//   EMPTY --claim_write--> WRITING --publish--> FULL --claim_read--> READING --release--> EMPTY
// The producer only ever writes slot head % K, the consumer only ever reads slot tail % K.
// Memory ordering:
//   * publish() is a release store of FULL after the payload and SlotMeta writes; the consumer's acquire load
//     that sees FULL therefore sees the whole payload and metadata (no torn messages).
//   * release() is a release store of EMPTY after the consumer finished reading the payload; the producer's
//     acquire load that sees EMPTY therefore cannot overwrite bytes the consumer is still reading.
//   * WRITING / READING are only set by the slot's owner of the moment; they make occupancy and timeout
//     messages precise and let the CUDA path hand the final store to a stream callback.
//   * head / tail (messages claimed for writing / reading) are written only by their owner and read relaxed by
//     anyone for occupancy; correctness never depends on them, only on the slot states.
// Waiting: spin ~20 us ($PIPEMORPH_STAGING_SPIN_US), then sleep in futex(FUTEX_WAIT) on the state word itself (a shared futex: works across
// processes), so a waiter costs no CPU and wakes as soon as the state changes. A waiter increments `waiters`
// (seq_cst) before re-reading the state (seq_cst); a storer stores the state, issues a seq_cst fence, then reads
// `waiters` and calls FUTEX_WAKE only if someone waits. This Dekker pair guarantees that either the waiter sees
// the new state or the storer sees the waiter; FUTEX_WAIT's own in-kernel compare closes the last gap. Waits
// are also cut into <= 100 ms pieces (timeouts, Python signal checks), so a missed wake could never hang.
// This header does not include torch: the CUDA file includes it and compiles with plain nvcc.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

namespace pipemorph {
namespace staging {

constexpr uint64_t kMagic = 0x50495045535447ULL;  // "PIPESTG"
constexpr uint32_t kLayoutVersion = 1;
constexpr int kMaxDims = 12;
constexpr uint64_t kPage = 4096;

enum SlotState : uint32_t { EMPTY = 0, WRITING = 1, FULL = 2, READING = 3 };

const char* state_name(uint32_t s);

static_assert(std::atomic<uint32_t>::is_always_lock_free, "cross-process atomics must be lock free");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "cross-process atomics must be lock free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "the state word doubles as a futex");

// What travels with the payload so any dtype and shape can go through. dtype is an opaque code chosen by the
// caller (the torch binding stores c10::ScalarType; both processes run the same torch).
struct SlotMeta {
  uint64_t seq;     // message number in this ring (0, 1, 2, ...); checked by the consumer
  int64_t tag;      // caller's tag (micro-batch id, ...)
  uint64_t nbytes;  // payload length
  int32_t dtype;
  int32_t ndim;
  int64_t shape[kMaxDims];
};

struct alignas(64) SlotHeader {
  std::atomic<uint32_t> state;    // SlotState; also the futex word
  std::atomic<uint32_t> waiters;  // processes blocked in FUTEX_WAIT on `state`
  SlotMeta meta;
  char pad[256 - 8 - sizeof(SlotMeta)];
};
static_assert(sizeof(SlotHeader) == 256, "SlotHeader must stay 256 bytes (layout version 1)");

struct alignas(64) RingHeader {
  std::atomic<uint64_t> magic;  // release-stored last by the creator: an attacher that sees kMagic sees the rest
  uint32_t layout_version;
  uint32_t num_slots;
  uint64_t slot_capacity;
  uint64_t slot_stride;
  uint64_t data_offset;
  uint64_t total_bytes;
  alignas(64) std::atomic<uint64_t> head;  // producer-owned: messages claimed for writing
  alignas(64) std::atomic<uint64_t> tail;  // consumer-owned: messages claimed for reading
};
static_assert(sizeof(RingHeader) <= kPage, "RingHeader must fit in the first page");

// Raised when a wait runs out of time; the message names the ring, the slot and the duration.
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Raised when a new ring cannot be sized: /dev/shm has no room for its slots (Python: StagingNoRoomError,
// a RuntimeError; the transport turns it into advice on delegation.slot_mb / slots).
struct NoRoomError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A claimed slot: where to write (or read) one message.
struct Slot {
  uint32_t index;
  uint64_t seq;
  SlotMeta* meta;
  void* payload;
  SlotHeader* header;
};

// Called about every 100 ms while waiting; may throw to abort the wait (the binding checks Python signals).
using PollFn = std::function<void()>;

class Ring {
 public:
  // Creates a new segment (fails if the name exists). name may omit the leading '/'.
  static Ring* create(const std::string& name, uint32_t num_slots, uint64_t slot_capacity);
  // Opens an existing segment, retrying until timeout_s while the creator has not finished initialising it.
  static Ring* attach(const std::string& name, double timeout_s);
  // Removes the name; mappings that exist stay valid until closed. Returns false if the name did not exist.
  static bool unlink_name(const std::string& name);

  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  void close();  // runs the before-unmap hook, then unmaps; idempotent. Never unlinks.
  // Called once by close() with (base, bytes) before munmap; the CUDA binding uses it to wait for in-flight
  // copies and cudaHostUnregister the mapping. Must not throw.
  void set_before_unmap(std::function<void(void*, uint64_t)> hook) { before_unmap_ = std::move(hook); }
  bool has_before_unmap() const { return static_cast<bool>(before_unmap_); }
  bool closed() const { return base_ == nullptr; }

  // Producer: waits (timeout_s < 0 = forever) for slot head % K to be EMPTY, marks it WRITING, advances head.
  // nbytes larger than the slot capacity is refused before waiting (std::length_error).
  Slot claim_write(uint64_t nbytes, double timeout_s, const PollFn& poll = nullptr);
  // Producer: makes a claimed slot visible to the consumer (release store of FULL, then wake a waiter).
  // Safe from any thread, including a CUDA host function (no CUDA call, at most one futex syscall).
  static void publish(SlotHeader* slot) { store_and_wake(slot, FULL); }

  // Producer: undoes claim_write when the copy could not even be started (slot back to EMPTY, head back).
  void abort_write(const Slot& slot);

  // Consumer: waits for slot tail % K to be FULL without claiming it (so a caller can look at the metadata and
  // refuse the message, which then stays in the ring). Returns false on timeout when throw_on_timeout is false.
  bool wait_readable(double timeout_s, const PollFn& poll, bool throw_on_timeout, Slot* out);
  // Consumer: claims the slot returned by wait_readable (FULL -> READING) and advances tail.
  void claim_read(const Slot& slot);
  // Consumer: undoes claim_read when the copy could not even be started (slot back to FULL, tail back).
  void abort_read(const Slot& slot);
  // Consumer: hands a slot back to the producer (release store of EMPTY, then wake a waiter).
  static void release(SlotHeader* slot) { store_and_wake(slot, EMPTY); }
  // Release store of `value` into the slot state; wakes the peer if it sleeps on it (see the header comment).
  static void store_and_wake(SlotHeader* slot, uint32_t value);

  // Zero-copy ends of a claimed slot (the delegate sends from / receives into the slot itself, §5.2):
  // the slot claimed for message seq must be in state `want`; returns it, or throws naming what is wrong.
  Slot claimed(uint64_t seq, uint32_t want) const;

  const std::string& name() const { return name_; }
  uint32_t num_slots() const;
  uint64_t slot_capacity() const;
  uint64_t occupancy() const;  // head - tail: messages written or in flight that are not yet claimed by a reader
  uint64_t head() const;
  uint64_t tail() const;
  void* base() const { return base_; }
  uint64_t mapped_bytes() const { return size_; }

 private:
  Ring(std::string name, void* base, uint64_t size);
  void check_open(const char* what) const;
  SlotHeader* slot_header(uint32_t i) const;
  void* payload(uint32_t i) const;
  Slot make_slot(uint32_t i, uint64_t seq) const;
  // Waits until slot i's state equals want; false on timeout.
  bool wait_state(uint32_t i, uint32_t want, double timeout_s, const PollFn& poll) const;

  std::string name_;
  void* base_;
  uint64_t size_;
  RingHeader* hdr_;
  std::function<void(void*, uint64_t)> before_unmap_;
};

}  // namespace staging
}  // namespace pipemorph
