// Decode attention over a paged KV cache, fp32 or bf16 (q, cache and out alike; a.bf16), or fp32 q
// and out over a bf16 cache (a.kv_bf16): one query token per sequence. bf16: q is widened into an
// fp32 scratch, K/V as they are loaded; the scores, softmax and accumulators are fp32 and each
// output row is rounded to bf16 once (fp32 out with a bf16 cache: not rounded).
//
// For sequence b and query head h (kv head g = h / (H / G)):
//   s_t = scale * <q[b, h], K[slot(b, t), g]>,  t < context_lens[b]
//   out[b, h] = sum_t softmax(s)_t * V[slot(b, t), g]
//   slot(b, t) = block_tables[b, t / block_size] * block_size + t % block_size
// K and V rows are read in place from the cache (no gather copy), whole slots at a time (all G kv
// heads, so memory is read sequentially within a block), and each kv head's K/V row is used by all
// H / G query heads of its group while it is in registers (attention_prims.h).
//
// Work item = (b, token range). Every context is split into ranges of kSplit tokens counted from
// the sequence's start (flash-decoding), whatever the batch and the thread count, so a sequence's
// result is bit-identical alone or batched, on 1 or 2 threads (continuous batching and speculative
// verification compare tokens across batch compositions); each range keeps per head its max m, sum
// l = sum exp(s - m) and unnormalised acc = sum exp(s - m) V, and ranges merge exactly (in order):
//   M = max_p m_p;  out = sum_p exp(m_p - M) acc_p / sum_p exp(m_p - M) l_p.
// Within a range the softmax is two-pass (scores to a scratch row, then max, exp, sum), exact and
// stable (every exponent is <= 0). A sequence with context length 0 gets zeros (and lse -inf). With
// a.lse set, lse[b, h] = M + log L (natural log), for merging with other partial attentions.
#include <omp.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "attention_prims.h"
#include "common.h"
#include "kernels.h"

namespace duet {
namespace {

using namespace attn;

constexpr int64_t kMinParallelWork = 1 << 17;  // sum(context) * H * D below which one thread wins
constexpr int64_t kSplit = 128;                // tokens per work item (fixed: batch- and thread-invariant)

inline int64_t index_at(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

struct Item {
  int64_t b, t0, t1;
};

// Walks tokens [t0, t1) of sequence b as runs of <= kRun consecutive slots within one block and
// calls f(offset from t0, first slot, run length).
template <typename F>
inline void for_each_run(const PagedDecodeArgs& a, int64_t b, int64_t t0, int64_t t1, F&& f) {
  const int64_t* bt64 = static_cast<const int64_t*>(a.block_tables) + b * a.bt_sb;
  const int32_t* bt32 = static_cast<const int32_t*>(a.block_tables) + b * a.bt_sb;
  int64_t j = t0 / a.block_size, off = t0 % a.block_size;
  for (int64_t t = t0; t < t1;) {
    const int64_t n = std::min({a.block_size - off, t1 - t, kRun});
    const int64_t blk = a.bt_is64 ? bt64[j] : bt32[j];
    f(t - t0, blk * a.block_size + off, n);
    t += n;
    off += n;
    if (off == a.block_size) off = 0, ++j;
  }
}

// Asks for the cache lines of run (slot, n) of one cache (K or V, slot stride ss elements of T) to
// be loaded ahead. A sequence's blocks lie anywhere in a pool much larger than the caches, and the
// hardware prefetchers stop at every block (page) boundary: without this, each run's first loads
// wait on DRAM one after another, and decode attention over a large batch ran at a fraction of the
// memory bandwidth (benchmarks/README.md, "decode attention prefetch").
template <typename T>
inline void prefetch_run(const T* cache, int64_t ss, int64_t slot, int64_t n, int64_t row_elems) {
  const char* p = reinterpret_cast<const char*>(cache + slot * ss);
  const int64_t bytes = ((n - 1) * ss + row_elems) * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

struct Run {
  int64_t i, slot, n;  // offset from the item's first token, first cache slot, length
};

// One work item: m[h], l[h] and the unnormalised acc[h * D + d] for all H heads of sequence b.
// next: the item that runs after this one on this thread (its first K run is prefetched), or null.
// T: q's element type; C: the cache's.
template <typename T, typename C>
void run_item(const PagedDecodeArgs& a, const Prims<C>& pr, const Item& it, const Item* next, float* m, float* l,
              float* acc) {
  const int64_t H = a.H, G = a.G, D = a.D, hpg = H / G, len = it.t1 - it.t0;
  static thread_local std::vector<float> scratch, qf;
  static thread_local std::vector<Run> runs;
  if (static_cast<int64_t>(scratch.size()) < H * len) scratch.resize(H * len);
  float* s = scratch.data();  // [H, len] scores, then unnormalised probabilities
  const T* qt = static_cast<const T*>(a.q) + it.b * a.q_sb;
  const float* q;
  int64_t q_sh = a.q_sh;
  if constexpr (sizeof(T) == 4) {
    q = qt;
  } else {  // bf16: the query heads widened to fp32 [H, D]
    if (static_cast<int64_t>(qf.size()) < H * D) qf.resize(H * D);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t d = 0; d < D; ++d) qf[h * D + d] = to_f32(qt[h * a.q_sh + d]);
    q = qf.data();
    q_sh = D;
  }
  const C* k_cache = static_cast<const C*>(a.k_cache);
  const C* v_cache = static_cast<const C*>(a.v_cache);
  // a slot's bytes that a run reads: from its first kv head's row to the end of its last one's
  const int64_t k_row = (G - 1) * a.k_sg + D, v_row = (G - 1) * a.v_sg + D;
  runs.clear();
  for_each_run(a, it.b, it.t0, it.t1, [&](int64_t i, int64_t slot, int64_t n) { runs.push_back({i, slot, n}); });
  const int64_t nr = static_cast<int64_t>(runs.size());
  // K runs one ahead (the first one unless the item before fetched it), the first V run while the
  // softmax of the scores runs, then the next item's first K run during the accumulation
  prefetch_run(k_cache, a.k_ss, runs[0].slot, runs[0].n, k_row);
  for (int64_t r = 0; r < nr; ++r) {
    const Run& u = runs[r];
    if (r + 1 < nr) prefetch_run(k_cache, a.k_ss, runs[r + 1].slot, runs[r + 1].n, k_row);
    const C* k = k_cache + u.slot * a.k_ss;
    for (int64_t g = 0; g < G; ++g)
      pr.scores(q + g * hpg * q_sh, q_sh, hpg, k + g * a.k_sg, a.k_ss, u.n, D, a.scale, s + g * hpg * len + u.i, len);
  }
  prefetch_run(v_cache, a.v_ss, runs[0].slot, runs[0].n, v_row);
  for (int64_t h = 0; h < H; ++h) {
    m[h] = pr.rowmax(s + h * len, len);
    l[h] = pr.expsum(s + h * len, len, m[h]);
  }
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t r = 0; r < nr; ++r) {
    const Run& u = runs[r];
    if (r + 1 < nr) {
      prefetch_run(v_cache, a.v_ss, runs[r + 1].slot, runs[r + 1].n, v_row);
    } else if (next != nullptr) {
      for_each_run(a, next->b, next->t0, next->t1, [&, done = false](int64_t, int64_t slot, int64_t n) mutable {
        if (!done) prefetch_run(k_cache, a.k_ss, slot, n, k_row), done = true;
      });
    }
    const C* v = v_cache + u.slot * a.v_ss;
    for (int64_t g = 0; g < G; ++g)
      pr.accum(s + g * hpg * len + u.i, len, hpg, u.n, v + g * a.v_sg, a.v_ss, D, acc + g * hpg * D);
  }
}

// out[b] from the items [i, j) of sequence b (consecutive in the item list).
template <typename T>
void merge(const PagedDecodeArgs& a, const std::vector<Item>& items, const float* part, int64_t per_item, int64_t i,
           int64_t j) {
  const int64_t H = a.H, D = a.D;
  std::vector<float> row(sizeof(T) == 4 ? 0 : D);  // bf16: the row in fp32, rounded once at the end
  for (int64_t h = 0; h < H; ++h) {
    float M = -std::numeric_limits<float>::infinity();
    for (int64_t p = i; p < j; ++p) M = std::max(M, part[p * per_item + h]);
    float L = 0.f;
    T* out = static_cast<T*>(a.out) + items[i].b * a.o_sb + h * a.o_sh;
    float* o;
    if constexpr (sizeof(T) == 4) {
      o = out;
    } else {
      o = row.data();
    }
    std::fill_n(o, D, 0.f);
    for (int64_t p = i; p < j; ++p) {
      const float* pp = part + p * per_item;
      const float w = std::exp(pp[h] - M);
      L += w * pp[H + h];
      const float* acc = pp + 2 * H + h * D;
      for (int64_t d = 0; d < D; ++d) o[d] += w * acc[d];
    }
    const float inv = 1.0f / L;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    if constexpr (sizeof(T) != 4)
      for (int64_t d = 0; d < D; ++d) out[d] = from_f32<T>(o[d]);
    if (a.lse) a.lse[items[i].b * a.lse_sb + h] = M + std::log(L);
  }
}

}  // namespace

std::string paged_decode_validate(const PagedDecodeArgs& a) {
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t ctx = index_at(a.context_lens, a.cl_is64, b);
    if (ctx < 0) return "context_lens[" + std::to_string(b) + "] = " + std::to_string(ctx) + " is negative";
    const int64_t nblk = (ctx + a.block_size - 1) / a.block_size;
    if (nblk > a.max_blocks)
      return "sequence " + std::to_string(b) + " has " + std::to_string(ctx) + " tokens = " + std::to_string(nblk) +
             " blocks but block_tables has " + std::to_string(a.max_blocks) + " columns";
    for (int64_t j = 0; j < nblk; ++j) {
      const int64_t blk = index_at(a.block_tables, a.bt_is64, b * a.bt_sb + j);
      const int64_t last = std::min(a.block_size, ctx - j * a.block_size) - 1;
      if (blk < 0 || blk * a.block_size + last >= a.S)
        return "block_tables[" + std::to_string(b) + ", " + std::to_string(j) + "] = " + std::to_string(blk) +
               " is outside the cache (" + std::to_string(a.S) + " slots of block_size " +
               std::to_string(a.block_size) + ")";
    }
  }
  return "";
}

namespace {

template <typename T, typename C>
void paged_decode(const PagedDecodeArgs& a, int max_threads) {
  const Prims<C> pr = prims_for<C>(active_isa());
  int64_t total_ctx = 0;
  for (int64_t b = 0; b < a.B; ++b) total_ctx += index_at(a.context_lens, a.cl_is64, b);
  const int nt0 = pick_threads(max_threads, total_ctx * a.H * a.D, kMinParallelWork, total_ctx);
  std::vector<Item> items;
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t ctx = index_at(a.context_lens, a.cl_is64, b);
    if (ctx == 0)
      for (int64_t h = 0; h < a.H; ++h) {
        std::fill_n(static_cast<T*>(a.out) + b * a.o_sb + h * a.o_sh, a.D, from_f32<T>(0.f));
        if (a.lse) a.lse[b * a.lse_sb + h] = -std::numeric_limits<float>::infinity();
      }
    for (int64_t t0 = 0; t0 < ctx; t0 += kSplit) items.push_back({b, t0, std::min(ctx, t0 + kSplit)});
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t per_item = a.H * (a.D + 2);  // m[H], l[H], acc[H * D]
  std::vector<float> part(n_items * per_item);
  auto run = [&](int64_t i, bool serial) {
    float* p = part.data() + i * per_item;
    run_item<T, C>(a, pr, items[i], serial && i + 1 < n_items ? &items[i + 1] : nullptr, p, p + a.H, p + 2 * a.H);
  };
  if (nt0 == 1 || n_items == 1) {
    for (int64_t i = 0; i < n_items; ++i) run(i, true);
  } else {  // which item a thread takes next is not known: none is prefetched across items
#pragma omp parallel for num_threads(nt0) schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; ++i) run(i, false);
  }
  for (int64_t i = 0; i < n_items;) {
    int64_t j = i + 1;
    while (j < n_items && items[j].b == items[i].b) ++j;
    merge<T>(a, items, part.data(), per_item, i, j);
    i = j;
  }
}

}  // namespace

void paged_decode_attention(const PagedDecodeArgs& a, int max_threads) {
  if (a.bf16) {
    paged_decode<bf16_t, bf16_t>(a, max_threads);
  } else if (a.kv_bf16) {
    paged_decode<float, bf16_t>(a, max_threads);
  } else {
    paged_decode<float, float>(a, max_threads);
  }
}

}  // namespace duet
