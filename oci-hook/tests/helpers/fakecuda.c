/* A stand-in libcuda.so.1 (built with -Wl,-soname,libcuda.so.1): one symbol to prove
 * which library the container's loader found. */
const char *kiwi_fake_cuda(void) { return "FAKE-LIBCUDA"; }
int cuInit(unsigned int flags) { (void)flags; return 0; }
