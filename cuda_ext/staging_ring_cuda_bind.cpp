// Python binding of the CUDA send/receive path: adds pin, push_cuda / pop_cuda (one tensor per slot) and
// end_write_cuda / end_read_cuda (finish a begin_write / begin_read with asynchronous copies of several spans)
// to the Ring class of the CPU binding. No CUDA headers: streams arrive from Python as integers
// (torch.cuda.Stream.cuda_stream) and device memory as addresses (Tensor.data_ptr()).
#include "staging_ring_cuda.h"
#include "staging_ring_torch.h"

#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;
using pipemorph::staging::destination;
using pipemorph::staging::fill_meta;
using pipemorph::staging::kCheckSignals;
using pipemorph::staging::kMaxDims;
using pipemorph::staging::Ring;
using pipemorph::staging::Slot;
using pipemorph::staging::timeout_or_forever;
namespace stcuda = pipemorph::staging::cuda;

namespace {

// (slot offset, device address, bytes) as Python passes them.
using PySpan = std::tuple<uint64_t, uint64_t, uint64_t>;

// Pins this process's mapping once; close() then waits for in-flight copies and unpins before munmap.
void ensure_pinned(Ring& ring) {
  if (ring.has_before_unmap()) return;
  stcuda::register_host(ring.base(), ring.mapped_bytes(), ring.name());
  ring.set_before_unmap([](void* base, uint64_t) { stcuda::unregister_host(base); });
}

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

// The spans of a claimed slot, checked to lie inside its message (a span past it would write or read bytes the
// peer does not own). On a bad span, `undo` gives the slot back first, so a caller's error leaves the ring usable.
std::vector<stcuda::Span> slot_spans(Ring& ring, const Slot& s, const std::vector<PySpan>& spans,
                                     void (Ring::*undo)(const Slot&)) {
  std::vector<stcuda::Span> out;
  out.reserve(spans.size());
  for (const auto& [off, dev, n] : spans) {
    if (off > s.meta->nbytes || n > s.meta->nbytes - off || (n > 0 && dev == 0)) {
      (ring.*undo)(s);
      throw std::invalid_argument("staging ring '" + ring.name() + "': span of " + std::to_string(n) +
                                  " bytes at offset " + std::to_string(off) + " does not fit message " +
                                  std::to_string(s.seq) + " (" + std::to_string(s.meta->nbytes) + " bytes)");
    }
    out.push_back(stcuda::Span{off, dev, n});
  }
  return out;
}

void push_cuda(Ring& ring, const at::Tensor& t, int64_t tag, const std::optional<double>& timeout_s,
               int64_t stream) {
  if (!t.is_cuda()) {
    throw std::invalid_argument("staging ring '" + ring.name() + "': push_cuda() takes a CUDA tensor, got one on " +
                                t.device().str());
  }
  if (!t.is_contiguous() || t.layout() != at::kStrided || t.dim() > kMaxDims) {
    throw std::invalid_argument("staging ring '" + ring.name() + "': push_cuda() takes a dense contiguous tensor with at most " +
                                std::to_string(kMaxDims) + " dimensions");
  }
  ensure_pinned(ring);
  const uint64_t nbytes = t.numel() * t.element_size();
  const stcuda::Span span{0, reinterpret_cast<uint64_t>(t.data_ptr()), nbytes};
  py::gil_scoped_release nogil;
  // Waits only while the ring is full (back-pressure); the copy itself is asynchronous.
  Slot s = ring.claim_write(nbytes, timeout_or_forever(timeout_s), kCheckSignals);
  fill_meta(s, t, tag);
  stcuda::enqueue_send(ring, s, &span, 1, as_stream(stream));
}

std::pair<at::Tensor, int64_t> pop_cuda(Ring& ring, const std::optional<double>& timeout_s,
                                        const std::optional<at::Tensor>& out, int64_t device, int64_t stream) {
  ensure_pinned(ring);
  py::gil_scoped_release nogil;
  Slot s;
  ring.wait_readable(timeout_or_forever(timeout_s), kCheckSignals, true, &s);
  at::Tensor dst = destination(ring, s, out, at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  const int64_t tag = s.meta->tag;  // read before the slot can be released by the stream callback
  const stcuda::Span span{0, reinterpret_cast<uint64_t>(dst.data_ptr()), s.meta->nbytes};
  ring.claim_read(s);
  stcuda::enqueue_recv(ring, s, &span, 1, as_stream(stream));
  return {dst, tag};
}

// Finishes begin_write(seq): the caller wrote the host-side bytes into the slot; the spans are copied from the
// device on `stream`, and a stream callback publishes the slot once they landed. Returns without waiting.
void end_write_cuda(Ring& ring, uint64_t seq, const std::vector<PySpan>& spans, int64_t stream) {
  const Slot s = ring.claimed(seq, pipemorph::staging::WRITING);
  const auto copies = slot_spans(ring, s, spans, &Ring::abort_write);
  ensure_pinned(ring);
  py::gil_scoped_release nogil;
  stcuda::enqueue_send(ring, s, copies.data(), copies.size(), as_stream(stream));
}

// Finishes begin_read(seq): the spans are copied to the device on `stream`, and a stream callback hands the
// slot back to the producer once they have read it. Returns without waiting.
void end_read_cuda(Ring& ring, uint64_t seq, const std::vector<PySpan>& spans, int64_t stream) {
  const Slot s = ring.claimed(seq, pipemorph::staging::READING);
  const auto copies = slot_spans(ring, s, spans, &Ring::abort_read);
  ensure_pinned(ring);
  py::gil_scoped_release nogil;
  stcuda::enqueue_recv(ring, s, copies.data(), copies.size(), as_stream(stream));
}

}  // namespace

void bind_cuda(py::class_<Ring>& cls) {
  cls.def("pin", &ensure_pinned, "Page-lock this process's mapping of the ring (done on first CUDA use if not before).")
      .def("push_cuda", &push_cuda, py::arg("tensor"), py::arg("tag"), py::arg("timeout_s"), py::arg("stream"),
           "Enqueue D2H copy + completion flag on `stream` (cudaStream_t as int); returns without waiting for it.")
      .def("pop_cuda", &pop_cuda, py::arg("timeout_s"), py::arg("out"), py::arg("device"), py::arg("stream"),
           "Wait for a message, enqueue its H2D copy + slot release on `stream`; returns (tensor, tag) at once.")
      .def("end_write_cuda", &end_write_cuda, py::arg("seq"), py::arg("spans"), py::arg("stream"),
           "Finish begin_write(seq): D2H copies of (slot offset, device address, bytes) spans on `stream`, then "
           "publish from a stream callback; returns at once.")
      .def("end_read_cuda", &end_read_cuda, py::arg("seq"), py::arg("spans"), py::arg("stream"),
           "Finish begin_read(seq): H2D copies of (slot offset, device address, bytes) spans on `stream`, then "
           "release the slot from a stream callback; returns at once.");
}
