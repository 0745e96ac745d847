// Point-to-point kernels over NVLink peer pointers: the host's stream-ordered put/signal/wait/barrier
// and the ping-pong used to measure signal latency. All pointers are 64-bit device addresses; peer
// pointers come from the symmetric heap's peer table (fluxrt/symmetric.py).
#include "fluxrt/comm.cuh"

using fluxrt::ErrorRecord;
using fluxrt::u32;
using fluxrt::u64;

extern "C" {

// SM push: the grid copies src -> dst (dst usually a peer pointer); the last block to finish then
// releases *flag (set to `value`, or add `value`). flag == nullptr: no signal.
__global__ void fluxrt_put_signal(char* dst, const char* src, u64 bytes, u64* flag, u64 value,
                                  int add, u32* block_counter) {
    fluxrt::put_grid(dst, src, bytes);
    if (flag != nullptr) fluxrt::grid_arrive_and_signal(block_counter, flag, value, add != 0);
}

// Stream-ordered signal from one thread: everything earlier on the stream is complete (kernel
// boundary), and signal_* adds the system-scope fence and release for peers reading the flag.
__global__ void fluxrt_signal(u64* flag, u64 value, int add) {
    if (add) fluxrt::signal_add(flag, value); else fluxrt::signal_set(flag, value);
}

// Stream-ordered bounded wait: work after this kernel on the stream sees the peer's data.
__global__ void fluxrt_wait(const u64* flag, u64 target, u64 timeout_ns, ErrorRecord* err, u32 op,
                            u32 rank, u64 peer) {
    fluxrt::wait_ge(flag, target, timeout_ns, err, op, rank, peer);
}

// Barrier across all ranks, one block of >= world threads.
__global__ void fluxrt_barrier(u64* const* peer_pads, const u64* pad, u32 rank, u32 world, u64 epoch,
                               u64 timeout_ns, ErrorRecord* err, u32 op) {
    fluxrt::barrier_block(peer_pads, pad, rank, world, epoch, fluxrt::Watch{timeout_ns, err, op, rank});
}

// Ping-pong between two ranks, one thread each. The initiator releases round i into the peer's
// flag and waits for the echo in its own; the responder echoes. Rounds use values base+1..base+iters.
// elapsed_ns[0] receives the initiator's time for all rounds (one way = elapsed / (2 * iters)).
__global__ void fluxrt_pingpong(u64* my_flag, u64* peer_flag, u64 base, u32 iters, int initiator,
                                u64 timeout_ns, ErrorRecord* err, u32 op, u32 rank, u64 peer,
                                u64* elapsed_ns) {
    const u64 t0 = fluxrt::globaltimer_ns();
    for (u32 i = 1; i <= iters; ++i) {
        if (initiator) {
            fluxrt::st_release_sys(peer_flag, base + i);  // no data guarded: release alone suffices
            if (!fluxrt::wait_ge(my_flag, base + i, timeout_ns, err, op, rank, peer)) return;
        } else {
            if (!fluxrt::wait_ge(my_flag, base + i, timeout_ns, err, op, rank, peer)) return;
            fluxrt::st_release_sys(peer_flag, base + i);
        }
    }
    if (initiator) elapsed_ns[0] = fluxrt::globaltimer_ns() - t0;
}

}  // extern "C"
