/* How far apart two cores are, as the caches see it: two processes, pinned one to each
 * core, pass a cache line back and forth (the one-way trip), then one writes a buffer and
 * the other copies it out (the bytes cross between the cores every time). Built and run
 * by bench/core_distance.py; it prints one line per round. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof s, &s);
}

/* Both sides meet at step `k`: side 0 posts it and waits for side 1's echo. */
static void meet(volatile uint64_t *f, int me, uint64_t k) {
    if (me == 0) { f[0] = k; while (f[8] != k) ; }
    else { while (f[0] != k) ; f[8] = k; }
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: core_distance ROUNDS BYTES CPU_A CPU_B\n");
        return 2;
    }
    int rounds = atoi(argv[1]), cpus[2] = {atoi(argv[3]), atoi(argv[4])};
    size_t n = (size_t)atoll(argv[2]);
    volatile uint64_t *f = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    char *buf = mmap(0, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (f == MAP_FAILED || buf == MAP_FAILED) { perror("mmap"); return 1; }
    memset(buf, 1, n);
    for (int r = 0; r < rounds; r++) {
        f[0] = f[8] = 0;
        pid_t pid = fork();
        int me = pid == 0;
        pin(cpus[me]);
        char *dst = malloc(n);
        memset(dst, 0, n);
        uint64_t k = 1;
        const int trips = 20000, copies = 100;
        meet(f, me, k++);
        double t0 = now();
        for (int i = 0; i < trips; i++) meet(f, me, k++);
        double trip = (now() - t0) / trips / 2;
        double copying = 0;
        for (int i = 0; i < copies; i++) {
            if (me == 0) memset(buf, i, n);          /* side 0 writes the bytes ... */
            meet(f, me, k++);
            if (me == 1) {                           /* ... side 1 copies them out */
                double a = now();
                memcpy(dst, buf, n);
                copying += now() - a;
            }
            meet(f, me, k++);
        }
        if (me) {
            f[16] = (uint64_t)(copying / copies * 1e9);
            _exit(0);
        }
        waitpid(pid, 0, 0);
        printf("%d %.0f %.1f\n", r, trip * 1e9, f[16] / 1e3);
        fflush(stdout);
        free(dst);
        usleep(200000);
    }
    return 0;
}
