// Fused NaN/Inf guard for vocoder output: one pass over a [B, T] audio batch that
//   (a) counts non-finite samples per row,
//   (b) finds the peak |x| over the finite samples per row,
//   (c) writes clipped int16 PCM: __float2int_rn(clamp(x, -1, 1) * 32767.0f), 0 where non-finite.
// The torch reference in kernels/guard.py does exactly the same float32 arithmetic,
// so results are bit-identical (round-to-nearest-even in both).
//
// Launch: grid = (blocks per row, rows), block = GUARD_THREADS threads. count[B] and
// peak_bits[B] must be zeroed by the caller; peak_bits holds the float's bit pattern, which
// orders like an int for non-negative floats, so atomicMax on int is a float max.
//
// Compiled by kernels/loader.py through pycuda (no_extern_c=True: cuda_fp16.h is C++).

#include <cuda_fp16.h>

#define GUARD_THREADS 256
#define GUARD_WARPS (GUARD_THREADS / 32)

// One sample: returns its PCM value and folds it into this thread's count and peak.
__device__ __forceinline__ short guard_sample(float v, int &bad, float &peak) {
    if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) {  // NaN or +-Inf
        ++bad;
        return 0;
    }
    peak = fmaxf(peak, fabsf(v));
    const float c = fminf(fmaxf(v, -1.0f), 1.0f);
    return (short)__float2int_rn(c * 32767.0f);
}

// Block-wide sum of `bad` and max of `peak`, then one atomic each per block and row.
__device__ __forceinline__ void guard_flush(int bad, float peak, int *count, int *peak_bits) {
    __shared__ int s_bad[GUARD_WARPS];
    __shared__ float s_peak[GUARD_WARPS];
    const unsigned full = 0xffffffffu;
    for (int off = 16; off > 0; off >>= 1) {
        bad += __shfl_down_sync(full, bad, off);
        peak = fmaxf(peak, __shfl_down_sync(full, peak, off));
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        s_bad[warp] = bad;
        s_peak[warp] = peak;
    }
    __syncthreads();
    if (warp == 0) {
        bad = lane < GUARD_WARPS ? s_bad[lane] : 0;
        peak = lane < GUARD_WARPS ? s_peak[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) {
            bad += __shfl_down_sync(full, bad, off);
            peak = fmaxf(peak, __shfl_down_sync(full, peak, off));
        }
        if (lane == 0) {
            if (bad) atomicAdd(count, bad);
            if (peak > 0.0f) atomicMax(peak_bits, __float_as_int(peak));
        }
    }
    __syncthreads();  // s_bad/s_peak are reused by the next row
}

extern "C" __global__ void __launch_bounds__(GUARD_THREADS)
guard_f32(const float *__restrict__ x, short *__restrict__ pcm, int *__restrict__ count,
          int *__restrict__ peak_bits, int rows, int n) {
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const float *xr = x + (size_t)row * n;
        short *pr = pcm + (size_t)row * n;
        int bad = 0;
        float peak = 0.0f;
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            pr[i] = guard_sample(__ldg(xr + i), bad, peak);
        }
        guard_flush(bad, peak, count + row, peak_bits + row);
    }
}

// FP16 input read as __half2 pairs. A row may start at an odd half (odd n, or a view with
// a storage offset): then its first sample is done alone so the pairs are 4-byte aligned,
// and an odd sample left at the end is done alone too.
extern "C" __global__ void __launch_bounds__(GUARD_THREADS)
guard_f16(const __half *__restrict__ x, short *__restrict__ pcm, int *__restrict__ count,
          int *__restrict__ peak_bits, int rows, int n) {
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const __half *xr = x + (size_t)row * n;
        short *pr = pcm + (size_t)row * n;
        int bad = 0;
        float peak = 0.0f;
        const int head = (n > 0 && (reinterpret_cast<size_t>(xr) & 3u)) ? 1 : 0;
        const int pairs = (n - head) >> 1;
        const __half2 *x2 = reinterpret_cast<const __half2 *>(xr + head);
        short *p2 = pr + head;
        const bool packed = (reinterpret_cast<size_t>(p2) & 3u) == 0;  // one 4-byte store
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs;
             i += gridDim.x * blockDim.x) {
            const float2 f = __half22float2(x2[i]);
            const short a = guard_sample(f.x, bad, peak);
            const short b = guard_sample(f.y, bad, peak);
            if (packed) {
                reinterpret_cast<short2 *>(p2)[i] = make_short2(a, b);
            } else {
                p2[2 * i] = a;
                p2[2 * i + 1] = b;
            }
        }
        if (blockIdx.x == 0 && threadIdx.x == 0 && head) {
            pr[0] = guard_sample(__half2float(xr[0]), bad, peak);
        }
        if (blockIdx.x == 0 && threadIdx.x == 32 && head + 2 * pairs < n) {
            pr[n - 1] = guard_sample(__half2float(xr[n - 1]), bad, peak);
        }
        guard_flush(bad, peak, count + row, peak_bits + row);
    }
}
