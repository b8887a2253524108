// Decode attention over an FP8 (e4m3) paged KV cache with a 16-bit query: one warp per (KV head, sequence, slice
// of the context), tensor-core products in float16 with float32 sums. Compiled at first use by NVRTC
// (paged_decode_cuda.py); it has no headers. Why not Triton: docs/fp8_kv_cache.md.
//
// Fragment plan (mma.m16n8k16; lane = 4 * g + t). Nothing goes through shared memory: each lane loads its own
// operand fragments from global memory in 16-byte loads.
//   S = Q.K^T over 16 tokens: A = the query (rows: the group's heads, padded to 16), B = K. The sum over the head
//       dims may take them in any order as long as Q and K agree, so lane (g, t) reads token g's dims
//       [t * D/4, (t+1) * D/4) contiguously; slab s uses four of them.
//   O^T = V^T.P^T: A = V^T (rows: head dims), B = P^T, which is S's accumulator as it stands (lane (g, t) holds
//       head g's probabilities for tokens 2t, 2t+1, 2t+8, 2t+9). Lane (g, t) reads those four tokens' dims
//       [g * D/8, (g+1) * D/8), pairs the tokens per dim by byte permutes, and so holds heads 2t, 2t+1 of the
//       output over those dims. Hence at most 8 query heads per KV head (B has 8 columns).

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef QUERY_BF16
#define QUERY_BF16 1
#endif
#ifndef MIN_BLOCKS  // resident warps per SM the register allocation must allow (1: no bound)
#define MIN_BLOCKS 1
#endif
#ifndef WARPS  // warps per (KV head, sequence, slice): each takes a contiguous share of the slice
#define WARPS 4
#endif

typedef unsigned int u32;
typedef unsigned short u16;

#define SLABS (HEAD_DIM / 16)      // k-slabs of S = Q.K^T
#define K_BYTES (HEAD_DIM / 4)     // bytes of a K row each lane reads
#define V_BYTES (HEAD_DIM / 8)     // bytes of a V row each lane reads
#define K_VECS (K_BYTES / 16)      // 16-byte loads per K row
#define V_WORDS (V_BYTES / 4)
#define NEG_INF (-__int_as_float(0x7f800000))

struct Tile {
    uint4 k[2][K_VECS];            // tokens g and g + 8
    u32 v[4][V_WORDS];             // tokens 2t, 2t + 1, 2t + 8, 2t + 9
};

// four e4m3 -> two f16x2 (bytes 0, 1 and bytes 2, 3), exact; one instruction each on Hopper
__device__ __forceinline__ void widen_e4m3x4(u32 word, u32& low, u32& high) {
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.rn.f16x2.e4m3x2 %0, lo;\ncvt.rn.f16x2.e4m3x2 %1, hi;\n}"
        : "=r"(low), "=r"(high) : "r"(word));
}

__device__ __forceinline__ u32 permute(u32 a, u32 b, u32 selector) {
    u32 out;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(selector));
    return out;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 out;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
}

__device__ __forceinline__ float exp2_approx(float x) {
    float out;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(out) : "f"(x));
    return out;
}

__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float query_to_float(u16 bits) {
#if QUERY_BF16
    return __uint_as_float(((u32)bits) << 16);
#else
    float out;
    asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(bits));
    return out;
#endif
}

__device__ __forceinline__ u16 float_to_output(float x) {
    u16 out;
#if QUERY_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(out) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(x));
#endif
    return out;
}


// where this lane's rows lie from a tile's first token (bytes; a page is small enough for 32 bits)
struct LaneRows {
    int k[2];  // tokens g, g + 8: dims [t * K_BYTES, (t + 1) * K_BYTES)
    int v[4];  // tokens 2t, 2t + 1, 2t + 8, 2t + 9: dims [g * V_BYTES, (g + 1) * V_BYTES)
};

// the rows of one 16-token tile this lane needs. In the slice's last tile (PARTIAL) rows past its end read as
// zeros: a zero widens to 0, while stale bytes there may be NaN codes, and 0 * NaN would reach the output.
template <bool PARTIAL>
__device__ __forceinline__ void load_tile(Tile& tile, const unsigned char* k_tile, const unsigned char* v_tile,
                                          const LaneRows& rows, int valid, int g, int t) {
    for (int half = 0; half < 2; ++half) {
        const uint4* src = (const uint4*)(k_tile + rows.k[half]);
        for (int i = 0; i < K_VECS; ++i)
            tile.k[half][i] = !PARTIAL || g + 8 * half < valid ? __ldg(src + i) : make_uint4(0, 0, 0, 0);
    }
    for (int r = 0; r < 4; ++r) {
        const bool live = !PARTIAL || 2 * t + (r & 1) + 8 * (r >> 1) < valid;
#if V_WORDS == 4
        uint4 words = live ? __ldg((const uint4*)(v_tile + rows.v[r])) : make_uint4(0, 0, 0, 0);
        tile.v[r][0] = words.x; tile.v[r][1] = words.y; tile.v[r][2] = words.z; tile.v[r][3] = words.w;
#else
        uint2 words = live ? __ldg((const uint2*)(v_tile + rows.v[r])) : make_uint2(0, 0);
        tile.v[r][0] = words.x; tile.v[r][1] = words.y;
#endif
    }
}

// walks a slice one 16-token tile at a time: the page's offset comes from the block table once per page, and
// only for pages the slice reaches (a step past its last page reads nothing: that entry may lie past the table)
struct Cursor {
    const int* table;
    long long block_stride, head_offset;
    int page, token_stride, page_index, in_page, pages;
    long long page_offset;

    __device__ __forceinline__ Cursor(const int* table_, int page_, long long block_stride_, long long head_offset_,
                                      int token_stride_, int first, int end)
        : table(table_), block_stride(block_stride_), head_offset(head_offset_), page(page_),
          token_stride(token_stride_), page_index(first / page_), in_page(first % page_),
          pages((end + page_ - 1) / page_) {
        page_offset = (long long)table[page_index] * block_stride + head_offset;
    }
    __device__ __forceinline__ long long offset() const { return page_offset + (long long)in_page * token_stride; }
    __device__ __forceinline__ void advance() {
        in_page += 16;
        if (in_page == page) {
            in_page = 0;
            if (++page_index < pages) page_offset = (long long)table[page_index] * block_stride + head_offset;
        }
    }
};

struct Softmax {
    float running_max;   // head g's, in base-2 logits (the same in the four lanes of a quad)
    float denominator;   // this lane's share of head g's sum
    float acc[SLABS][4]; // O^T: heads 2t, 2t + 1 over dims 16 g + 2 m (+1) (see the plan above)
};

template <bool PARTIAL>
__device__ __forceinline__ void attend(Softmax& state, const Tile& tile, const u32 (&query)[SLABS][4],
                                       float scale_log2, int valid, int g, int t) {
    float scores[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    for (int half = 0; half < 2; ++half) {
        for (int s = 0; s < SLABS; ++s) {
            const uint4& vec = tile.k[half][s / 4];
            const u32 word = (s % 4 == 0) ? vec.x : (s % 4 == 1) ? vec.y : (s % 4 == 2) ? vec.z : vec.w;
            u32 k_low, k_high;
            widen_e4m3x4(word, k_low, k_high);
            mma(scores[half], query[s][0], query[s][1], query[s][2], query[s][3], k_low, k_high);
        }
    }
    // lane (g, t) holds head g's logits for tokens 2t, 2t + 1 (half 0) and 8 + 2t, 9 + 2t (half 1)
    float tile_max = NEG_INF;
    for (int half = 0; half < 2; ++half)
        for (int j = 0; j < 2; ++j) {
            const int token = 8 * half + 2 * t + j;
            scores[half][j] = !PARTIAL || token < valid ? scores[half][j] * scale_log2 : NEG_INF;
            tile_max = fmaxf(tile_max, scores[half][j]);
        }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float new_max = fmaxf(state.running_max, tile_max);
    const float rescale = exp2_approx(state.running_max - new_max);  // 0 on the first tile (-inf - finite)
    float probs[2][2];
    float tile_sum = 0.f;
    for (int half = 0; half < 2; ++half)
        for (int j = 0; j < 2; ++j) {
            probs[half][j] = exp2_approx(scores[half][j] - new_max);
            tile_sum += probs[half][j];
        }
    state.denominator = state.denominator * rescale + tile_sum;
    state.running_max = new_max;
    // the accumulator holds heads 2t and 2t + 1: their rescale lives in quads 2t and 2t + 1
    const float rescale_even = __shfl_sync(0xffffffffu, rescale, 8 * t);
    const float rescale_odd = __shfl_sync(0xffffffffu, rescale, 8 * t + 4);
    // once the maximum settles (most tiles) nothing needs rescaling: skip the multiplies when no head moved
    const bool rescaled = __any_sync(0xffffffffu, rescale != 1.f);
    const u32 p_first = pack_f16x2(probs[0][0], probs[0][1]);
    const u32 p_second = pack_f16x2(probs[1][0], probs[1][1]);
    for (int w = 0; w < V_WORDS; ++w) {
        // tokens side by side per dim: {token 2t, token 2t + 1} for dims 4w .. 4w + 3 of this lane's slice
        const u32 near_lo = permute(tile.v[0][w], tile.v[1][w], 0x5140);
        const u32 near_hi = permute(tile.v[0][w], tile.v[1][w], 0x7362);
        const u32 far_lo = permute(tile.v[2][w], tile.v[3][w], 0x5140);
        const u32 far_hi = permute(tile.v[2][w], tile.v[3][w], 0x7362);
        for (int pair = 0; pair < 2; ++pair) {
            const int m = 2 * w + pair;
            const u32 near = pair ? near_hi : near_lo;
            const u32 far = pair ? far_hi : far_lo;
            float (&acc)[4] = state.acc[m];
            if (rescaled) {
                acc[0] *= rescale_even; acc[1] *= rescale_odd; acc[2] *= rescale_even; acc[3] *= rescale_odd;
            }
            u32 near_low, near_high, far_low, far_high;
            widen_e4m3x4(near, near_low, near_high);
            widen_e4m3x4(far, far_low, far_high);
            mma(acc, near_low, near_high, far_low, far_high, p_first, p_second);
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, (MIN_BLOCKS + WARPS - 1) / WARPS) fp8_paged_decode(
    const u16* __restrict__ query, const unsigned char* __restrict__ k_cache,
    const unsigned char* __restrict__ v_cache, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, u16* __restrict__ out, float* __restrict__ part_out,
    float* __restrict__ part_lse, int* __restrict__ counters, float scale_log2, float value_scale, int split_len,
    int num_splits, int group, int num_kv_heads, int page, long long query_stride, long long out_stride,
    long long table_stride, long long block_stride, long long token_stride, long long head_stride) {
    const int kv_head = blockIdx.x, seq = blockIdx.y, split = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int context_len = context_lens[seq];
    const int num_heads = num_kv_heads * group;
    // lane (g, t) writes heads 2t + h (h = 0, 1) over dims [g * V_BYTES, (g + 1) * V_BYTES)
    if (context_len == 0) {  // a CUDA-graph padding row: zeros
        if (split == 0 && warp == 0)
            for (int h = 0; h < 2; ++h)
                if (2 * t + h < group)
                    for (int d = 0; d < V_BYTES; ++d)
                        out[seq * out_stride + (long long)(kv_head * group + 2 * t + h) * HEAD_DIM + g * V_BYTES + d] =
                            0;
        return;
    }
    const int slice_start = split * split_len;
    if (slice_start >= context_len) return;
    const int slice_end = min(slice_start + split_len, context_len);
    // this warp's share: whole 16-token tiles, only the last share may end in a partial one (or be empty)
    const int share = ((slice_end - slice_start + WARPS - 1) / WARPS + 15) / 16 * 16;
    const int start = min(slice_start + warp * share, slice_end);
    const int end = min(start + share, slice_end);
    const int slices = (context_len + split_len - 1) / split_len;

    // the query, in this lane's order of dims (see the plan): head g, dims [t * K_BYTES, (t + 1) * K_BYTES)
    // rows g + 8 of the A operand are padding (GROUP <= 8): zeros kept in registers, not rebuilt per product
    u32 q_frag[SLABS][4];
    {
        const u16* row = query + seq * query_stride + (long long)(kv_head * group + g) * HEAD_DIM + t * K_BYTES;
        for (int s = 0; s < SLABS; ++s) {
            float x[4];
            for (int j = 0; j < 4; ++j) x[j] = g < group ? query_to_float(row[4 * s + j]) : 0.f;
            q_frag[s][0] = pack_f16x2(x[0], x[1]);
            q_frag[s][1] = 0u;
            q_frag[s][2] = pack_f16x2(x[2], x[3]);
            q_frag[s][3] = 0u;
        }
    }
    Softmax state;
    state.running_max = NEG_INF;
    state.denominator = 0.f;
    for (int m = 0; m < SLABS; ++m)
        for (int j = 0; j < 4; ++j) state.acc[m][j] = 0.f;

    LaneRows rows;
    for (int half = 0; half < 2; ++half) rows.k[half] = (g + 8 * half) * (int)token_stride + t * K_BYTES;
    for (int r = 0; r < 4; ++r) rows.v[r] = (2 * t + (r & 1) + 8 * (r >> 1)) * (int)token_stride + g * V_BYTES;
    // whole 16-token tiles, the next one's loads in flight while one is computed (two named tiles: an array indexed
    // by a loop variable would live in local memory), then the slice's last, partial tile if it has one.
    const int whole_tiles = (end - start) / 16;
    Cursor cursor = start < end ? Cursor(block_tables + seq * table_stride, page, block_stride, kv_head * head_stride, (int)token_stride,
                  start, end) : Cursor(block_tables + seq * table_stride, page, block_stride, kv_head * head_stride,
                                       (int)token_stride, slice_start, slice_end);
    Tile even, odd;
    if (whole_tiles > 0) {
        load_tile<false>(even, k_cache + cursor.offset(), v_cache + cursor.offset(), rows, 16, g, t);
        cursor.advance();
    }
    for (int tile = 0; tile < whole_tiles; ++tile) {
        if (tile + 1 < whole_tiles) {
            load_tile<false>(odd, k_cache + cursor.offset(), v_cache + cursor.offset(), rows, 16, g, t);
            cursor.advance();
        }
        attend<false>(state, even, q_frag, scale_log2, 16, g, t);
        if (++tile >= whole_tiles) break;
        if (tile + 1 < whole_tiles) {
            load_tile<false>(even, k_cache + cursor.offset(), v_cache + cursor.offset(), rows, 16, g, t);
            cursor.advance();
        }
        attend<false>(state, odd, q_frag, scale_log2, 16, g, t);
    }
    const int rest = end - start - 16 * whole_tiles;
    if (rest > 0) {
        load_tile<true>(even, k_cache + cursor.offset(), v_cache + cursor.offset(), rows, rest, g, t);
        attend<true>(state, even, q_frag, scale_log2, rest, g, t);
    }

    // head g's sum over the quad; heads 2t and 2t + 1's sums and maxima for this lane's outputs
    float denominator = state.denominator;
    denominator += __shfl_xor_sync(0xffffffffu, denominator, 1);
    denominator += __shfl_xor_sync(0xffffffffu, denominator, 2);
    float running_max = state.running_max;
#if WARPS > 1
    // the warps' shares merged into warp 0: one maximum per head, each share's sums rescaled to it
    __shared__ float share_max[WARPS][8], share_sum[WARPS][8];
    __shared__ float share_acc[WARPS - 1][SLABS * 4][32];
    if (t == 0) {
        share_max[warp][g] = running_max;
        share_sum[warp][g] = denominator;
    }
    __syncthreads();
    float top = NEG_INF;
    for (int w = 0; w < WARPS; ++w) top = fmaxf(top, share_max[w][g]);
    // heads 2t, 2t + 1 (this lane's accumulator columns): their maxima live in rows 2t, 2t + 1
    float top_pair[2] = {NEG_INF, NEG_INF};
    for (int w = 0; w < WARPS; ++w)
        for (int h = 0; h < 2; ++h) top_pair[h] = fmaxf(top_pair[h], share_max[w][2 * t + h]);
    if (warp > 0) {
        float factor[2];
        for (int h = 0; h < 2; ++h) factor[h] = exp2_approx(share_max[warp][2 * t + h] - top_pair[h]);
        for (int m = 0; m < SLABS; ++m)
            for (int j = 0; j < 4; ++j) share_acc[warp - 1][m * 4 + j][lane] = state.acc[m][j] * factor[j & 1];
    }
    __syncthreads();
    if (warp > 0) return;
    float total = 0.f;
    for (int w = 0; w < WARPS; ++w) total += share_sum[w][g] * exp2_approx(share_max[w][g] - top);
    {
        float factor[2];
        for (int h = 0; h < 2; ++h) factor[h] = exp2_approx(share_max[0][2 * t + h] - top_pair[h]);
        for (int m = 0; m < SLABS; ++m)
            for (int j = 0; j < 4; ++j) {
                float sum = state.acc[m][j] * factor[j & 1];
                for (int w = 1; w < WARPS; ++w) sum += share_acc[w - 1][m * 4 + j][lane];
                state.acc[m][j] = sum;
            }
    }
    denominator = total;
    running_max = top;
#endif
    const float lse = running_max + __log2f(denominator);
    const float inv[2] = {value_scale / __shfl_sync(0xffffffffu, denominator, 8 * t),
                          value_scale / __shfl_sync(0xffffffffu, denominator, 8 * t + 4)};
    float result[2][V_BYTES];
    for (int m = 0; m < SLABS; ++m)
        for (int h = 0; h < 2; ++h) {
            result[h][2 * m] = state.acc[m][h] * inv[h];
            result[h][2 * m + 1] = state.acc[m][2 + h] * inv[h];
        }
    const int head_base = seq * num_heads + kv_head * group;
    if (slices == 1) {
        for (int h = 0; h < 2; ++h)
            if (2 * t + h < group)
                for (int d = 0; d < V_BYTES; ++d)
                    out[seq * out_stride + (long long)(kv_head * group + 2 * t + h) * HEAD_DIM + g * V_BYTES + d] =
                        float_to_output(result[h][d]);
        return;
    }
    for (int h = 0; h < 2; ++h)
        if (2 * t + h < group) {
            float* dst = part_out + ((long long)(head_base + 2 * t + h) * num_splits + split) * HEAD_DIM + g * V_BYTES;
            for (int d = 0; d < V_BYTES; d += 4)
                *(float4*)(dst + d) = make_float4(result[h][d], result[h][d + 1], result[h][d + 2], result[h][d + 3]);
        }
    if (t == 0 && g < group) part_lse[(long long)(head_base + g) * num_splits + split] = lse;

    // the last slice to finish merges them all; the fence orders this warp's partials before its ticket
    __threadfence();
    __syncwarp();
    int ticket = 0;
    if (lane == 0) ticket = atomicAdd(counters + seq * num_kv_heads + kv_head, 1);
    ticket = __shfl_sync(0xffffffffu, ticket, 0);
    __syncwarp();  // orders the other lanes' reads below after lane 0's ticket (as a block barrier would)
    if (ticket != slices - 1) return;
    __threadfence();
    for (int h = 0; h < 2; ++h) {
        if (2 * t + h >= group) continue;
        const long long first_part = (long long)(head_base + 2 * t + h) * num_splits;
        float top = NEG_INF;
        for (int other = 0; other < slices; ++other) top = fmaxf(top, __ldcg(part_lse + first_part + other));
        float merged[V_BYTES];
        for (int d = 0; d < V_BYTES; ++d) merged[d] = 0.f;
        float total = 0.f;
        for (int other = 0; other < slices; ++other) {
            const float weight = exp2_approx(__ldcg(part_lse + first_part + other) - top);
            const float* src = part_out + (first_part + other) * HEAD_DIM + g * V_BYTES;
            for (int d = 0; d < V_BYTES; d += 4) {
                const float4 part = __ldcg((const float4*)(src + d));
                merged[d] += weight * part.x; merged[d + 1] += weight * part.y;
                merged[d + 2] += weight * part.z; merged[d + 3] += weight * part.w;
            }
            total += weight;
        }
        for (int d = 0; d < V_BYTES; ++d)
            out[seq * out_stride + (long long)(kv_head * group + 2 * t + h) * HEAD_DIM + g * V_BYTES + d] =
                float_to_output(merged[d] / total);
    }
    if (lane == 0) atomicExch(counters + seq * num_kv_heads + kv_head, 0);
}
