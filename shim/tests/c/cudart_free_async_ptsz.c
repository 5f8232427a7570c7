/* cudart_free_async.c with the per-thread default stream (the runtime calls the
 * `_ptsz` entry points) and its per-thread part. */
#define CUDA_API_PER_THREAD_DEFAULT_STREAM 1
#define PER_THREAD 1
#include "cudart_free_async.c"
