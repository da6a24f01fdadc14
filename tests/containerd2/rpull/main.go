// Pulls an image into containerd the way its CRI plugin does for a remote
// snapshotter: client.Pull with unpacking into the named snapshotter and
// the CRI's label handler (pkg/snapshotters.AppendInfoHandlerWrapper),
// which labels each layer with the image ref, manifest and layer digests,
// so that the snapshotter may pull the layers itself.
//
// containerd 2.4's client (github.com/containerd/containerd/v2 v2.4.2);
// the containerd 1.6 twin is tests/containerd-rpull. Built with Go modules
// (go.mod one directory up) by crates/cairn/tests/privileged_snapshotter.rs.
//
// Usage: rpull ADDRESS NAMESPACE SNAPSHOTTER REF (plain HTTP to the registry)
//
// With RPULL_USER and RPULL_PASSWORD in the environment the resolver
// authenticates with those credentials (basic, or a token they buy).
package main

import (
	"context"
	"fmt"
	"os"

	containerd "github.com/containerd/containerd/v2/client"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/containerd/v2/pkg/namespaces"
	snpkg "github.com/containerd/containerd/v2/pkg/snapshotters"
)

func main() {
	if len(os.Args) != 5 {
		fmt.Fprintln(os.Stderr, "usage: rpull ADDRESS NAMESPACE SNAPSHOTTER REF")
		os.Exit(2)
	}
	address, ns, sn, ref := os.Args[1], os.Args[2], os.Args[3], os.Args[4]
	client, err := containerd.New(address)
	if err != nil {
		fmt.Fprintln(os.Stderr, "connecting:", err)
		os.Exit(1)
	}
	defer client.Close()
	ctx := namespaces.WithNamespace(context.Background(), ns)
	hostOpts := []docker.RegistryOpt{docker.WithPlainHTTP(docker.MatchAllHosts)}
	if user, pass := os.Getenv("RPULL_USER"), os.Getenv("RPULL_PASSWORD"); user != "" && pass != "" {
		hostOpts = append(hostOpts, docker.WithAuthorizer(docker.NewDockerAuthorizer(
			docker.WithAuthCreds(func(string) (string, string, error) { return user, pass, nil }),
		)))
	}
	resolver := docker.NewResolver(docker.ResolverOptions{
		Hosts: docker.ConfigureDefaultRegistries(hostOpts...),
	})
	img, err := client.Pull(ctx, ref,
		containerd.WithResolver(resolver),
		containerd.WithPullUnpack,
		containerd.WithPullSnapshotter(sn),
		containerd.WithImageHandlerWrapper(snpkg.AppendInfoHandlerWrapper(ref)),
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, "pulling:", err)
		os.Exit(1)
	}
	fmt.Println(img.Name(), img.Target().Digest)
}
