/* A small seeded stand-in for LTP's fsstress (not packaged in Debian):
 * P worker processes, each doing N operations drawn from a fixed mix of
 * create/write/truncate/rename/link/unlink/mkdir/rmdir/stat/setxattr in
 * its own subdirectory of DIR. Same seed, same operations.
 *
 *   fsstress -d DIR [-n 500] [-p 20] [-s SEED]
 *
 * Built static by bench/run3.sh (gcc -static -O2) so it runs in a busybox
 * container. Prints "ops=N failed=N seconds=S"; exits 1 if a worker died.
 * Failed operations (ENOENT on a name another op removed, ENOTEMPTY, ...)
 * are expected and counted, as fsstress does. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

static uint64_t rng;
static uint64_t next(void) { /* xorshift64* */
	rng ^= rng >> 12; rng ^= rng << 25; rng ^= rng >> 27;
	return rng * 2685821657736338717ULL;
}
static unsigned pick(unsigned n) { return (unsigned)(next() % n); }

#define NAMES 64
static void name(char *buf, size_t len) {
	unsigned d = pick(8), f = pick(NAMES);
	if (d < 4) snprintf(buf, len, "d%u/f%u", d, f);
	else snprintf(buf, len, "f%u", f);
}

static char wbuf[65536];

static int worker(const char *dir, int id, int nops, uint64_t seed) {
	char path[64], p2[64];
	int failed = 0;
	rng = seed * 0x9E3779B97F4A7C15ULL + (uint64_t)id * 7919 + 1;
	for (size_t i = 0; i < sizeof wbuf; i++) wbuf[i] = (char)next();
	snprintf(path, sizeof path, "%s/p%d", dir, id);
	if (mkdir(path, 0755) && errno != EEXIST) return -1;
	if (chdir(path)) return -1;
	for (int i = 0; i < 4; i++) { snprintf(path, sizeof path, "d%d", i); mkdir(path, 0755); }
	for (int op = 0; op < nops; op++) {
		int r = 0, fd;
		struct stat st;
		name(path, sizeof path);
		switch (pick(20)) {
		case 0: case 1: case 2: /* create */
			fd = open(path, O_CREAT | O_WRONLY, 0644);
			r = fd < 0 ? -1 : close(fd);
			break;
		case 3: case 4: case 5: case 6: { /* write */
			off_t off = pick(1 << 20);
			size_t n = 1 + pick(sizeof wbuf);
			fd = open(path, O_CREAT | O_WRONLY, 0644);
			if (fd < 0) { r = -1; break; }
			r = pwrite(fd, wbuf, n, off) < 0 ? -1 : 0;
			close(fd);
			break;
		}
		case 7: case 8: /* truncate */
			r = truncate(path, pick(1 << 20));
			break;
		case 9: case 10: /* rename */
			name(p2, sizeof p2);
			r = rename(path, p2);
			break;
		case 11: /* link */
			name(p2, sizeof p2);
			r = link(path, p2);
			break;
		case 12: case 13: /* unlink */
			r = unlink(path);
			break;
		case 14: /* mkdir */
			snprintf(p2, sizeof p2, "d%u/s%u", pick(4), pick(8));
			r = mkdir(p2, 0755);
			break;
		case 15: /* rmdir */
			snprintf(p2, sizeof p2, "d%u/s%u", pick(4), pick(8));
			r = rmdir(p2);
			break;
		case 16: case 17: case 18: /* stat */
			r = lstat(path, &st);
			break;
		case 19: { /* setxattr */
			char v[32];
			snprintf(v, sizeof v, "v%u", pick(1000));
			r = lsetxattr(path, "user.fsstress", v, strlen(v), 0);
			break;
		}
		}
		if (r) failed++;
	}
	return failed;
}

int main(int argc, char **argv) {
	const char *dir = NULL;
	int nops = 500, nproc = 20, c;
	uint64_t seed = 1;
	while ((c = getopt(argc, argv, "d:n:p:s:")) != -1) {
		switch (c) {
		case 'd': dir = optarg; break;
		case 'n': nops = atoi(optarg); break;
		case 'p': nproc = atoi(optarg); break;
		case 's': seed = strtoull(optarg, NULL, 10); break;
		default: dir = NULL; optind = argc; break;
		}
	}
	if (!dir || nops < 1 || nproc < 1) {
		fprintf(stderr, "usage: fsstress -d DIR [-n OPS] [-p PROCS] [-s SEED]\n");
		return 2;
	}
	if (mkdir(dir, 0755) && errno != EEXIST) { perror(dir); return 1; }
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	int pipefd[2];
	if (pipe(pipefd)) { perror("pipe"); return 1; }
	for (int i = 0; i < nproc; i++) {
		pid_t pid = fork();
		if (pid < 0) { perror("fork"); return 1; }
		if (pid == 0) {
			int f = worker(dir, i, nops, seed);
			if (write(pipefd[1], &f, sizeof f) != sizeof f) _exit(1);
			_exit(f < 0 ? 1 : 0);
		}
	}
	close(pipefd[1]);
	int bad = 0, st, f;
	long failed = 0;
	while (wait(&st) > 0)
		if (!WIFEXITED(st) || WEXITSTATUS(st)) bad++;
	while (read(pipefd[0], &f, sizeof f) == sizeof f)
		if (f > 0) failed += f;
	clock_gettime(CLOCK_MONOTONIC, &t1);
	printf("ops=%ld failed=%ld seconds=%.6f\n", (long)nops * nproc, failed,
	       (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
	return bad ? 1 : 0;
}
