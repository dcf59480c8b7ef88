// Concern: what every native file shares (not installed, not part of the ABI): the status of the
// last call and the exception guard (defined in dspark_status.cpp), and a GGUF file's metadata
// (header-only).  The headers of the other concerns: dspark_simd.h, dspark_scan.h, dspark_result.h.
#pragma once

#include "dspark_shim.h"

#include "ggml.h"
#include "gguf.h"

#include <cstdint>
#include <exception>
#include <new>

namespace dspark {

// Sets the thread-local error message (printf-style) and returns code.  Never throws.
int32_t fail(int32_t code, const char * fmt, ...) noexcept
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
// Clears the thread-local error message (the call succeeded).
void ok() noexcept;

// Every extern "C" entry point runs its body through one of these: a C++ exception (std::bad_alloc
// from a std::vector, anything llama.cpp / ggml throws) becomes DSPARK_E_INTERNAL plus a message
// naming the entry point, instead of unwinding into C (std::terminate, i.e. an abort).
int32_t exception_status(const char * fn) noexcept;  // call only from inside a catch block

template <class F>
int32_t guard(const char * fn, F && body) noexcept {
    try {
        return body();
    } catch (...) {
        return exception_status(fn);
    }
}

template <class T, class F>
T * guard_ptr(const char * fn, F && body) noexcept {
    try {
        return body();
    } catch (...) {
        exception_status(fn);
        return nullptr;
    }
}

template <class F>
void guard_void(const char * fn, F && body) noexcept {
    try {
        body();
    } catch (...) {
        exception_status(fn);
    }
}

// A GGUF file's metadata (and tensor descriptors, no data, when with_tensors); g is null when the
// file cannot be read.
struct gguf_file {
    gguf_context * g    = nullptr;
    ggml_context * meta = nullptr;
    explicit gguf_file(const char * path, bool with_tensors) {
        gguf_init_params p = { /*no_alloc*/ true, with_tensors ? &meta : nullptr };
        g = gguf_init_from_file(path, p);
    }
    ~gguf_file() {
        if (g) gguf_free(g);
        if (meta) ggml_free(meta);
    }
    gguf_file(const gguf_file &) = delete;
    gguf_file & operator=(const gguf_file &) = delete;
};

}  // namespace dspark
