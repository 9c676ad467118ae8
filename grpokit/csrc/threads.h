/* Running a kernel's jobs on threads, shared by grpokit's native kernels (grpokit/cbuild.py builds
 * each kernel with this directory on the include path, and names a build by these headers too). */
#ifndef GRPOKIT_THREADS_H
#define GRPOKIT_THREADS_H

#include <pthread.h>
#include <stddef.h>

/* fn(job) for each of the n jobs laid out `size` bytes apart from `jobs`: job 0 on the calling
 * thread, the others on threads of their own; a job whose thread cannot start runs here. */
static void run_jobs(void *jobs, size_t size, int n, void *(*fn)(void *)) {
    pthread_t tid[64];
    int started[64] = {0};
    char *at = (char *)jobs;
    if (n > 64) n = 64;
    for (int t = 1; t < n; t++)
        started[t] = pthread_create(&tid[t], NULL, fn, at + t * size) == 0;
    fn(at);
    for (int t = 1; t < n; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else fn(at + t * size);
    }
}

#endif
