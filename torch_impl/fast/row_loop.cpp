// A decode step's float32 products, y = x @ weight.T for a few rows of x, the weight's output rows
// dealt across torch's threads in contiguous blocks: llama.cpp's split of a matrix-vector product.
// torch_impl/fast/row_loop.py builds this file with torch's cpp_extension and calls it through ctypes;
// rms_norm, at the end, is the step's other operation that eager torch runs as many small calls.
//
// The OpenMP below is torch's own: the library is linked against libgomp.so.1, and the dynamic
// loader hands it the libgomp torch loaded first, so these are torch's intra-op threads, the pool
// its other operations use, not a second pool spinning beside it.
//
// Numerics: each output is one weight row's dot product with one input row, summed in vector lanes
// (`omp simd reduction` lets the compiler reassociate the sum; fused multiply-adds are allowed). A row
// is never split between threads, so every thread count gives the same bits; no finite-math
// assumption, so an overflow still reaches the output as inf or nan.
#include <algorithm>
#include <cmath>
#include <cstdint>

extern "C" void row_products(const float* weight, const float* x, float* y, int64_t rows, int64_t width,
                             int64_t count, int64_t blocks) {
  // weight [rows, width] (C order), x [count, width], y [count, rows]; blocks: the threads asked for
  const int64_t each = (rows + blocks - 1) / blocks;  // output rows a block holds (the last may hold fewer)
#pragma omp parallel for num_threads(blocks) schedule(static, 1)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t end = std::min(rows, (block + 1) * each);
    for (int64_t row = block * each; row < end; ++row) {
      const float* w = weight + row * width;  // read once from memory, then met by every input row from cache
      for (int64_t r = 0; r < count; ++r) {
        const float* in = x + r * width;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t k = 0; k < width; ++k) total += w[k] * in[k];
        y[r * rows + row] = total;
      }
    }
  }
}

// The same step's RMSNorm, y = x / sqrt(mean(x^2) + eps) * weight, one call a norm instead of the small
// operators model.py's RMSNorm takes in eager torch (16 us against 5 us a norm of one row of 576, with
// Python's share; 61 norms a SmolLM2 step). The reference's order of roundings is kept: x times the
// reciprocal root, then the weight; the sum of squares is reassociated in vector lanes, as the products are.
extern "C" void rms_norm(const float* x, const float* weight, float* y, int64_t count, int64_t width, float eps) {
  // x [count, width], weight [width], y [count, width]; one thread: a norm reads 2 KB a row
  for (int64_t r = 0; r < count; ++r) {
    const float* in = x + r * width;
    float* out = y + r * width;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t k = 0; k < width; ++k) total += in[k] * in[k];
    const float scale = 1.0f / std::sqrt(total / static_cast<float>(width) + eps);
#pragma omp simd
    for (int64_t k = 0; k < width; ++k) out[k] = (in[k] * scale) * weight[k];
  }
}
