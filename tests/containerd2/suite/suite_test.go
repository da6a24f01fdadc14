// Runs containerd 2.4's own snapshotter test suite (core/snapshots/testsuite
// of github.com/containerd/containerd/v2 v2.4.2, a Go module) against `cairn
// snapshotter`, through containerd's proxy snapshotter client. The
// containerd 1.6 twin of this file is tests/containerd-suite.
//
// Built with Go modules (go.mod one directory up) by
// crates/cairn/tests/privileged_snapshotter.rs, which runs the binary as
// root with CAIRN_BIN naming the cairn binary. Every test of the suite
// gets a fresh store and snapshotter process under its own root; after the
// process stops, the chain images it left mounted are unmounted.
package suite

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	snapshotsapi "github.com/containerd/containerd/api/services/snapshots/v1"
	"github.com/containerd/containerd/v2/core/mount"
	"github.com/containerd/containerd/v2/core/snapshots"
	"github.com/containerd/containerd/v2/core/snapshots/proxy"
	"github.com/containerd/containerd/v2/core/snapshots/testsuite"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func newSnapshotter(ctx context.Context, root string) (snapshots.Snapshotter, func() error, error) {
	bin := os.Getenv("CAIRN_BIN")
	if bin == "" {
		return nil, nil, fmt.Errorf("CAIRN_BIN is not set")
	}
	store := filepath.Join(root, "store")
	sock := filepath.Join(root, "run", "snapshotter.sock")
	cmd := exec.Command(bin, "--root", store, "snapshotter", "--address", sock)
	cmd.Stdout = os.Stderr
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	stop := func() error {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		return unmountUnder(root)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			_ = stop()
			return nil, nil, fmt.Errorf("%s did not appear", sock)
		}
		time.Sleep(10 * time.Millisecond)
	}
	conn, err := grpc.Dial("unix://"+sock,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		}))
	if err != nil {
		_ = stop()
		return nil, nil, err
	}
	sn := proxy.NewSnapshotter(snapshotsapi.NewSnapshotsClient(conn), "cairn")
	return sn, func() error {
		conn.Close()
		return stop()
	}, nil
}

// unmountUnder unmounts every mount below root, deepest first.
func unmountUnder(root string) error {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	var targets []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		// Field 5 is the mount point, with space, tab, newline and
		// backslash octal-escaped; our roots have none of those.
		if strings.HasPrefix(f[4], root+"/") {
			targets = append(targets, f[4])
		}
	}
	sort.Sort(sort.Reverse(sort.StringSlice(targets)))
	for _, t := range targets {
		if err := mount.UnmountAll(t, syscall.MNT_DETACH); err != nil {
			return fmt.Errorf("unmounting %s: %w", t, err)
		}
	}
	return nil
}

func TestCairnSnapshotter(t *testing.T) {
	if os.Getuid() != 0 {
		t.Fatal("containerd's snapshotter suite mounts: run it as root")
	}
	testsuite.SnapshotterSuite(t, "cairn", newSnapshotter)
}

// TestCairnOverlayfsRules runs the suite under the name "overlayfs". The
// name changes one thing only: the Rename test leaves out the rename of a
// directory of a lower layer, which overlayfs without redirect_dir refuses
// with EXDEV (containerd 2.4's suite leaves it out for its overlayfs,
// fuse-overlayfs and EROFS snapshotters for that reason). cairn's active
// snapshots are such overlays (no redirect_dir, so that the upper
// directory stays an OCI layer: docs/snapshotter.md, "Mounts"); the test
// runs TestCairnSnapshotter without Rename and this with Rename only.
func TestCairnOverlayfsRules(t *testing.T) {
	if os.Getuid() != 0 {
		t.Fatal("containerd's snapshotter suite mounts: run it as root")
	}
	testsuite.SnapshotterSuite(t, "overlayfs", newSnapshotter)
}
