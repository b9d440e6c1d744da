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
#include <vector>

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

// One decode step's attention in one layer, for every row's one new token, in place of the ~40 small
// operators eager torch runs between the qkv product and the output product (RoPE's halves, the cache's
// writes and views, the heads' transposes, scaled_dot_product_attention: ~80 us a layer of SmolLM2's
// step, with Python's share). model.py's order: q and k rotated (x * cos + rotated * sin, the rotated
// half negated first), k and v written at their slot of the cache, then each query head attends over
// the slots filled so far through its group's key/value head (GQA), softmax(q . k * scale) . v.
// Rounding differs from torch's kernel only in the order of the sums (and fused multiply-adds).
static void rotate(const float* x, const float* cos, const float* sin, float* y, int64_t dim) {
  // x, cos, sin, y [dim]; cos and sin null: no rotation (a model with learned positions)
  const int64_t half = dim / 2;
  if (cos == nullptr) {
    std::copy(x, x + dim, y);
    return;
  }
  for (int64_t i = 0; i < half; ++i) y[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
  for (int64_t i = half; i < dim; ++i) y[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

extern "C" void decode_attention(const float* qkv, const float* cos, const float* sin, float* keys, float* values,
                                 float* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                                 int64_t slots, int64_t slot, int64_t filled, float scale, int64_t threads) {
  // qkv [B, (H + 2 Hkv) Dh]: each row's q heads, k heads, v heads; cos, sin [Dh]: every row's position
  // is the same (no row is padded), or null (learned positions); keys, values: this layer's
  // [B, Hkv, S, Dh]; out [B, H Dh]; slot: where this token goes; filled: the slots attended (this one
  // included); threads: the heads dealt across them (a long cache)
  const int64_t width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      const int64_t at = ((b * kv_heads + g) * slots + slot) * dim;  // [b, g, slot, :]
      rotate(qkv + b * width + (heads + g) * dim, cos, sin, keys + at, dim);
      const float* v = qkv + b * width + (heads + kv_heads + g) * dim;
      std::copy(v, v + dim, values + at);
    }
  }
  // Only a long cache is worth a second thread: at SmolLM2's step a layer's keys are ~20 KB.
#pragma omp parallel for num_threads(threads) if (threads > 1 && filled * batch * heads >= 8192) schedule(static)
  for (int64_t bh = 0; bh < batch * heads; ++bh) {
    const int64_t b = bh / heads, h = bh % heads, g = h / group;
    std::vector<float> q(dim), scores(filled);
    rotate(qkv + b * width + h * dim, cos, sin, q.data(), dim);
    const float* k = keys + (b * kv_heads + g) * slots * dim;  // [S, Dh]
    const float* v = values + (b * kv_heads + g) * slots * dim;  // [S, Dh]
    float top = -INFINITY;
    for (int64_t j = 0; j < filled; ++j) {
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t d = 0; d < dim; ++d) total += q[d] * k[j * dim + d];
      scores[j] = total * scale;
      top = std::max(top, scores[j]);
    }
    float* y = out + b * heads * dim + h * dim;
    std::fill(y, y + dim, 0.0f);
    float sum = 0.0f;
    for (int64_t j = 0; j < filled; ++j) {
      const float p = std::exp(scores[j] - top);
      sum += p;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) y[d] += p * v[j * dim + d];
    }
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) y[d] /= sum;
  }
}
