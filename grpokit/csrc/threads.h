/* Running a kernel's jobs on threads, shared by grpokit's native kernels (grpokit/cbuild.py builds
 * each kernel with this directory on the include path, and names a build by these headers too). */
#ifndef GRPOKIT_THREADS_H
#define GRPOKIT_THREADS_H

#include <stddef.h>
#include <stdint.h>

#define MAX_JOBS 64

/* how many jobs to split n items into for `threads` threads: 1 to MAX_JOBS, at most one per item */
static inline int job_count(int threads, int64_t n) {
    if (threads > MAX_JOBS) threads = MAX_JOBS;
    if (threads > n) threads = (int)n;
    return threads < 1 ? 1 : threads;
}

#ifdef _OPENMP
/* Built with OpenMP (grpokit/cbuild.py does so where PyTorch's own parallel backend is the GNU
 * OpenMP runtime already loaded in the process): the jobs run on that runtime's thread team, the
 * one PyTorch's operations and GEMMs use, instead of threads of our own competing with its
 * spinning workers for the same cores. */
static void run_jobs(void *jobs, size_t size, int n, void *(*fn)(void *)) {
    char *at = (char *)jobs;
    if (n <= 1) {
        if (n == 1) fn(at);
        return;
    }
#pragma omp parallel for num_threads(n) schedule(static, 1)
    for (int t = 0; t < n; t++) fn(at + t * size);
}
#else
#include <pthread.h>

/* fn(job) for each of the n jobs laid out `size` bytes apart from `jobs`: job 0 on the calling
 * thread, the others on threads of their own; a job whose thread cannot start runs here. */
static void run_jobs(void *jobs, size_t size, int n, void *(*fn)(void *)) {
    pthread_t tid[MAX_JOBS];
    int started[MAX_JOBS] = {0};
    char *at = (char *)jobs;
    if (n > MAX_JOBS) n = MAX_JOBS;
    for (int t = 1; t < n; t++)
        started[t] = pthread_create(&tid[t], NULL, fn, at + t * size) == 0;
    fn(at);
    for (int t = 1; t < n; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else fn(at + t * size);
    }
}
#endif

#endif
