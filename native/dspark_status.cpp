// Concern: the status of the last call, and the exception guard.  The thread-local error message
// (dspark::fail / dspark::ok, read back by dspark_last_error), the conversion of a caught C++
// exception into DSPARK_E_INTERNAL (dspark::exception_status, behind dspark::guard*), and the
// guard's test hook dspark_test_throw.  The bottom of the native layer: every other file calls in
// here, and this file calls none of them.
#include "dspark_internal.h"

#include <cstdarg>
#include <cstdio>
#include <exception>
#include <new>
#include <stdexcept>
#include <vector>

namespace dspark {

namespace {
thread_local char g_last_error[1024];  // a fixed buffer: setting the message cannot throw
}

int32_t fail(int32_t code, const char * fmt, ...) noexcept {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof(g_last_error), fmt, ap);
    va_end(ap);
    return code;
}

void ok() noexcept { g_last_error[0] = '\0'; }

int32_t exception_status(const char * fn) noexcept {
    try {
        throw;
    } catch (const std::bad_alloc &) {
        return fail(DSPARK_E_INTERNAL, "%s: out of memory (C++ std::bad_alloc)", fn);
    } catch (const std::exception & e) {
        return fail(DSPARK_E_INTERNAL, "%s: C++ exception: %s", fn, e.what());
    } catch (...) {
        return fail(DSPARK_E_INTERNAL, "%s: unknown C++ exception", fn);
    }
}

}  // namespace dspark

using dspark::ok;

// (cannot throw: no guard needed)
extern "C" const char * dspark_last_error(void) { return dspark::g_last_error; }

extern "C" int32_t dspark_test_throw(int32_t kind) {
    return dspark::guard(__func__, [&]() -> int32_t {
        switch (kind) {
            case 0: throw std::runtime_error("planted exception");
            case 1: throw std::bad_alloc();
            case 2: throw 42;
            case 3: {  // a real allocation failure
                std::vector<float> huge((size_t) 1 << 42);  // 16 TiB
                return (int32_t) huge.size();
            }
            default: break;
        }
        ok();
        return DSPARK_OK;
    });
}
