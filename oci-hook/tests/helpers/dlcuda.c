/* dlopens libcuda.so.1 by name, as the CUDA runtime does, so the container's loader
 * must find it through its ld cache; prints what it found. */
#include <dlfcn.h>
#include <stdio.h>

int main(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) {
        printf("DLOPEN-FAIL: %s\n", dlerror());
        return 0;
    }
    const char *(*tag)(void) = (const char *(*)(void))dlsym(h, "kiwi_fake_cuda");
    printf("DLOPEN-OK:%s\n", tag ? tag() : "no-tag");
    return 0;
}
