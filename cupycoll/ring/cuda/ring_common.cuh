// Element kinds and reduction ops shared by the ring kernels (ring_reduce.cu).
//
// No CUDA header is included: NVRTC does not reliably find cuda_fp16.h / cuda_bf16.h on
// CI machines, so fp16 and bf16 travel as their raw 16-bit patterns (unsigned short) and
// are converted with PTX and bit arithmetic. Every kind names two types:
//   Storage  the element as it lies in the caller's buffers;
//   Acc      the type partial results are computed in and sent between ranks in.
// Acc is float for fp16/bf16 (one rounding, at the very end) and Storage otherwise.

namespace cupycoll {

typedef unsigned long long u64;

// ------------------------------------------------------------------ bit-level conversions

__device__ __forceinline__ float f16_to_f32(unsigned short bits) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
}

__device__ __forceinline__ unsigned short f32_to_f16(float value) {
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));  // PTX keeps NaN a NaN
    return bits;
}

__device__ __forceinline__ float bits_as_f32(unsigned int bits) {
    float value;
    asm("mov.b32 %0, %1;" : "=f"(value) : "r"(bits));
    return value;
}

__device__ __forceinline__ unsigned int f32_as_bits(float value) {
    unsigned int bits;
    asm("mov.b32 %0, %1;" : "=r"(bits) : "f"(value));
    return bits;
}

// bf16 is the upper half of an fp32, so widening is exact.
__device__ __forceinline__ float bf16_to_f32(unsigned short bits) {
    return bits_as_f32(static_cast<unsigned int>(bits) << 16);
}

// Round to nearest, ties to even, done by hand so that it works on every architecture
// (cvt.rn.bf16.f32 needs sm_80). Adding 0x7fff plus the lowest kept bit carries into the
// kept half exactly when the dropped half is above the tie, or at the tie with an odd
// kept half; an overflow carries into the exponent and yields infinity, as it should.
// NaN must not take part: the carry could turn a NaN payload into infinity.
__device__ __forceinline__ unsigned short f32_to_bf16(float value) {
    unsigned int bits = f32_as_bits(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return static_cast<unsigned short>((bits >> 16) | 0x0040u);  // quiet NaN, sign kept
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<unsigned short>(bits >> 16);
}

// ------------------------------------------------------------------------- element kinds

struct F16 {
    typedef unsigned short Storage;
    typedef float Acc;
    static __device__ __forceinline__ Acc widen(Storage x) { return f16_to_f32(x); }
    static __device__ __forceinline__ Storage narrow(Acc x) { return f32_to_f16(x); }
};

struct BF16 {
    typedef unsigned short Storage;
    typedef float Acc;
    static __device__ __forceinline__ Acc widen(Storage x) { return bf16_to_f32(x); }
    static __device__ __forceinline__ Storage narrow(Acc x) { return f32_to_bf16(x); }
};

template <typename T>
struct Same {
    typedef T Storage;
    typedef T Acc;
    static __device__ __forceinline__ Acc widen(Storage x) { return x; }
    static __device__ __forceinline__ Storage narrow(Acc x) { return x; }
};

typedef Same<float> F32;
typedef Same<double> F64;
typedef Same<signed char> I8;
typedef Same<unsigned char> U8;  // also bool: torch stores bools as bytes 0 / 1
typedef Same<int> I32;
typedef Same<long long> I64;

// ----------------------------------------------------------------- wrapping integer maths

// Integer SUM / PRODUCT wrap around like NCCL's (two's complement). Signed overflow is
// undefined in C++, so int and long long compute in their unsigned twins.
template <typename T>
struct Wrapping {
    static __device__ __forceinline__ T add(T a, T b) { return static_cast<T>(a + b); }
    static __device__ __forceinline__ T mul(T a, T b) { return static_cast<T>(a * b); }
};

template <>
struct Wrapping<int> {
    static __device__ __forceinline__ int add(int a, int b) {
        return static_cast<int>(static_cast<unsigned int>(a) + static_cast<unsigned int>(b));
    }
    static __device__ __forceinline__ int mul(int a, int b) {
        return static_cast<int>(static_cast<unsigned int>(a) * static_cast<unsigned int>(b));
    }
};

template <>
struct Wrapping<long long> {
    static __device__ __forceinline__ long long add(long long a, long long b) {
        return static_cast<long long>(static_cast<u64>(a) + static_cast<u64>(b));
    }
    static __device__ __forceinline__ long long mul(long long a, long long b) {
        return static_cast<long long>(static_cast<u64>(a) * static_cast<u64>(b));
    }
};

// signed char / unsigned char promote to int, whose sum cannot overflow; the cast back
// wraps. bool never reaches add/mul (its SUM is MAX, its PRODUCT is MIN).

// AVG divides once, at the end: C's truncating division for integers (as ncclAvg),
// IEEE division in the accumulation type for floating point.
template <typename A>
__device__ __forceinline__ A divide(A x, long long divisor) {
    return static_cast<A>(static_cast<long long>(x) / divisor);
}
template <>
__device__ __forceinline__ float divide<float>(float x, long long divisor) {
    return x / static_cast<float>(divisor);
}
template <>
__device__ __forceinline__ double divide<double>(double x, long long divisor) {
    return x / static_cast<double>(divisor);
}

// -------------------------------------------------------------------------------- ops

// An op says how two accumulated values combine, and whether each rank's contribution is
// scaled first (premul) or the final value divided by the world size (average).
struct OpSum {
    static constexpr bool premul = false, average = false;
    template <typename A> static __device__ __forceinline__ A combine(A a, A b) { return Wrapping<A>::add(a, b); }
};
struct OpAvg {
    static constexpr bool premul = false, average = true;
    template <typename A> static __device__ __forceinline__ A combine(A a, A b) { return Wrapping<A>::add(a, b); }
};
struct OpPremulSum {
    static constexpr bool premul = true, average = false;
    template <typename A> static __device__ __forceinline__ A combine(A a, A b) { return a + b; }
};
struct OpProd {
    static constexpr bool premul = false, average = false;
    template <typename A> static __device__ __forceinline__ A combine(A a, A b) { return Wrapping<A>::mul(a, b); }
};
// MIN / MAX propagate NaN (as torch.minimum / torch.maximum do); `b != b` is false for
// integers and folds away.
struct OpMin {
    static constexpr bool premul = false, average = false;
    template <typename A> static __device__ __forceinline__ A combine(A a, A b) { return (b < a || b != b) ? b : a; }
};
struct OpMax {
    static constexpr bool premul = false, average = false;
    template <typename A> static __device__ __forceinline__ A combine(A a, A b) { return (b > a || b != b) ? b : a; }
};
struct OpBand {
    static constexpr bool premul = false, average = false;
    template <typename A> static __device__ __forceinline__ A combine(A a, A b) { return static_cast<A>(a & b); }
};
struct OpBor {
    static constexpr bool premul = false, average = false;
    template <typename A> static __device__ __forceinline__ A combine(A a, A b) { return static_cast<A>(a | b); }
};
struct OpBxor {
    static constexpr bool premul = false, average = false;
    template <typename A> static __device__ __forceinline__ A combine(A a, A b) { return static_cast<A>(a ^ b); }
};

}  // namespace cupycoll
