// The switch of the F16C conversions of float16 rows (row_dtype.h).
#include "row_dtype.h"

#include "kvemb_native.h"

extern "C" int kv_set_f16c(int64_t enable) {
#if defined(KV_F16C_CLONES)
  kvemb::f16c_allowed.store(enable != 0, std::memory_order_relaxed);
  return kvemb::use_f16c() ? 1 : 0;
#else
  (void)enable;
  return 0;
#endif
}
