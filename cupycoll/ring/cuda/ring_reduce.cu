// The ring algorithm's element-wise kernels (cupycoll/ring.py launches them).
//
// Four kinds, each instantiated per element kind E and op Op (ring_common.cuh), all with
// the same parameter list so that the launcher treats them alike:
//
//   (local, incoming, out, n, factor_ptr, factor, divisor)
//
//   ring_stage         out[i] = own(local[i])                       Acc partial, to send
//   ring_reduce        out[i] = Op(own(local[i]), incoming[i])      Acc partial, to send
//   ring_reduce_final  out[i] = finish(Op(own(local[i]), incoming[i]))   Storage result
//   ring_final         out[i] = finish(own(local[i]))              Storage (world size 1)
//
// own(x) widens this rank's element to Acc and, for PREMUL_SUM, scales it by the factor
// (read from factor_ptr when it is not null, else the by-value factor); finish(a) divides
// by `divisor` for AVG and narrows to Storage. Parameters a kind does not use are ignored.
// `incoming` and `out` may be the same buffer, and so may `local` and `out`: each thread
// reads an element before it writes it, so no pointer is declared __restrict__.
//
// The launcher compiles with --fmad=false, so that own() and Op round separately: a
// PREMUL_SUM result is the rounded product added to the partial, exactly as the numpy
// simulator in cupycoll/ring_schedule.py computes it.

#include "ring_common.cuh"

namespace cupycoll {

// N elements moved by one wide (up to 16-byte) memory access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
    T v[N];
};

template <bool Condition, typename IfTrue, typename IfFalse>
struct Pick { typedef IfTrue type; };
template <typename IfTrue, typename IfFalse>
struct Pick<false, IfTrue, IfFalse> { typedef IfFalse type; };

__device__ __forceinline__ bool aligned_to(const void* pointer, u64 bytes) {
    return reinterpret_cast<u64>(pointer) % bytes == 0;
}

template <class E, class Op, bool Incoming, bool Final>
struct Elementwise {
    typedef typename E::Storage S;
    typedef typename E::Acc A;
    typedef typename Pick<Final, S, A>::type Out;
    // Acc is never narrower than Storage, so 16-byte Acc packs bound every access.
    static constexpr int N = sizeof(A) >= 16 ? 1 : 16 / sizeof(A);

    static __device__ __forceinline__ Out one(S local, A incoming, A factor, long long divisor) {
        A value = E::widen(local);
        if constexpr (Op::premul) value = value * factor;
        if constexpr (Incoming) value = Op::template combine<A>(value, incoming);
        if constexpr (Final) {
            if constexpr (Op::average) value = divide<A>(value, divisor);
            return E::narrow(value);
        } else {
            return value;
        }
    }

    static __device__ __forceinline__ void run(const S* local, const A* incoming, Out* out, u64 n,
                                               const S* factor_ptr, A factor, long long divisor) {
        if constexpr (Op::premul) {
            if (factor_ptr != nullptr) factor = E::widen(*factor_ptr);
        }
        // Wide accesses need every pointer aligned to its pack; a slice that starts at an
        // odd offset (reduce_scatter blocks of any length) takes the scalar path instead.
        bool wide = aligned_to(local, N * sizeof(S)) && aligned_to(out, N * sizeof(Out)) &&
                    (!Incoming || aligned_to(incoming, N * sizeof(A)));
        u64 packs = wide ? n / N : 0;
        u64 first = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
        u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;

        for (u64 p = first; p < packs; p += stride) {
            Pack<S, N> mine = reinterpret_cast<const Pack<S, N>*>(local)[p];
            Pack<A, N> theirs;
            if constexpr (Incoming) theirs = reinterpret_cast<const Pack<A, N>*>(incoming)[p];
            Pack<Out, N> result;
#pragma unroll
            for (int j = 0; j < N; ++j) {
                A other = A();
                if constexpr (Incoming) other = theirs.v[j];
                result.v[j] = one(mine.v[j], other, factor, divisor);
            }
            reinterpret_cast<Pack<Out, N>*>(out)[p] = result;
        }
        for (u64 i = packs * N + first; i < n; i += stride) {
            A other = A();
            if constexpr (Incoming) other = incoming[i];
            out[i] = one(local[i], other, factor, divisor);
        }
    }
};

template <class E, class Op>
__global__ void ring_stage(const typename E::Storage* local, const typename E::Acc* incoming,
                           typename E::Acc* out, u64 n, const typename E::Storage* factor_ptr,
                           typename E::Acc factor, long long divisor) {
    Elementwise<E, Op, false, false>::run(local, incoming, out, n, factor_ptr, factor, divisor);
}

template <class E, class Op>
__global__ void ring_reduce(const typename E::Storage* local, const typename E::Acc* incoming,
                            typename E::Acc* out, u64 n, const typename E::Storage* factor_ptr,
                            typename E::Acc factor, long long divisor) {
    Elementwise<E, Op, true, false>::run(local, incoming, out, n, factor_ptr, factor, divisor);
}

template <class E, class Op>
__global__ void ring_reduce_final(const typename E::Storage* local, const typename E::Acc* incoming,
                                  typename E::Storage* out, u64 n,
                                  const typename E::Storage* factor_ptr, typename E::Acc factor,
                                  long long divisor) {
    Elementwise<E, Op, true, true>::run(local, incoming, out, n, factor_ptr, factor, divisor);
}

template <class E, class Op>
__global__ void ring_final(const typename E::Storage* local, const typename E::Acc* incoming,
                           typename E::Storage* out, u64 n, const typename E::Storage* factor_ptr,
                           typename E::Acc factor, long long divisor) {
    Elementwise<E, Op, false, true>::run(local, incoming, out, n, factor_ptr, factor, divisor);
}

}  // namespace cupycoll
