/* The node tier's sandbox ("pause") process: PID 1 of every pod. It holds the pod's
 * namespaces, reaps children re-parented to it, and exits on SIGINT/SIGTERM. No registry
 * can be reached here, so the image is built from this file (scripts/node.sh images). */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stop;

static void on_term(int sig) { (void)sig; stop = 1; }
static void on_chld(int sig) {
  (void)sig;
  while (waitpid(-1, 0, WNOHANG) > 0) {}
}

int main(void) {
  struct sigaction term = {0}, chld = {0};
  term.sa_handler = on_term;
  chld.sa_handler = on_chld;
  chld.sa_flags = SA_NOCLDSTOP;
  sigaction(SIGINT, &term, 0);
  sigaction(SIGTERM, &term, 0);
  sigaction(SIGCHLD, &chld, 0);
  while (!stop) pause();
  return 0;
}
