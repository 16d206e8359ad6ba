// Python binding of the CUDA send/receive path: adds push_cuda / pop_cuda / pin to the Ring class of the CPU
// binding. No CUDA headers: streams arrive from Python as integers (torch.cuda.Stream.cuda_stream).
#include "staging_ring_cuda.h"
#include "staging_ring_torch.h"

#include <utility>

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

// Pins this process's mapping once; close() then waits for in-flight copies and unpins before munmap.
void ensure_pinned(Ring& ring) {
  if (ring.has_before_unmap()) return;
  stcuda::register_host(ring.base(), ring.mapped_bytes(), ring.name());
  ring.set_before_unmap([](void* base, uint64_t) { stcuda::unregister_host(base); });
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
  py::gil_scoped_release nogil;
  // Waits only while the ring is full (back-pressure); the copy itself is asynchronous.
  Slot s = ring.claim_write(nbytes, timeout_or_forever(timeout_s), kCheckSignals);
  fill_meta(s, t, tag);
  stcuda::enqueue_send(ring, s, t.data_ptr(), nbytes, reinterpret_cast<void*>(stream));
}

std::pair<at::Tensor, int64_t> pop_cuda(Ring& ring, const std::optional<double>& timeout_s,
                                        const std::optional<at::Tensor>& out, int64_t device, int64_t stream) {
  ensure_pinned(ring);
  py::gil_scoped_release nogil;
  Slot s;
  ring.wait_readable(timeout_or_forever(timeout_s), kCheckSignals, true, &s);
  at::Tensor dst = destination(ring, s, out, at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  const int64_t tag = s.meta->tag;  // read before the slot can be released by the stream callback
  const uint64_t nbytes = s.meta->nbytes;
  ring.claim_read(s);
  stcuda::enqueue_recv(ring, s, dst.data_ptr(), nbytes, reinterpret_cast<void*>(stream));
  return {dst, tag};
}

}  // namespace

void bind_cuda(py::class_<Ring>& cls) {
  cls.def("pin", &ensure_pinned, "Page-lock this process's mapping of the ring (done on first CUDA push/pop).")
      .def("push_cuda", &push_cuda, py::arg("tensor"), py::arg("tag"), py::arg("timeout_s"), py::arg("stream"),
           "Enqueue D2H copy + completion flag on `stream` (cudaStream_t as int); returns without waiting for it.")
      .def("pop_cuda", &pop_cuda, py::arg("timeout_s"), py::arg("out"), py::arg("device"), py::arg("stream"),
           "Wait for a message, enqueue its H2D copy + slot release on `stream`; returns (tensor, tag) at once.");
}
