#!/usr/bin/env python3
"""Adds an image to an OCI layout (made if missing) from compressed layer blobs.

  oci_layout.py LAYOUT TAG CMD_JSON LAYER...

LAYER is "PATH:DIFF_ID:MEDIA_TYPE" (PATH a compressed layer tar, DIFF_ID the
sha256 of the uncompressed tar as sha256:HEX). Blobs are hard-linked into the
layout (copied across filesystems). The config has PATH in its Env and
CMD_JSON (a JSON list) as Cmd; the tag replaces any image of that name.
"""

import hashlib
import json
import os
import shutil
import sys


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def main():
    layout, tag, cmd = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    blobs = os.path.join(layout, "blobs", "sha256")
    os.makedirs(blobs, exist_ok=True)

    def put_file(path):
        d = sha256_file(path)
        dst = os.path.join(blobs, d)
        if not os.path.exists(dst):
            try:
                os.link(path, dst)
            except OSError:
                shutil.copyfile(path, dst)
        return "sha256:" + d, os.path.getsize(path)

    def put(data):
        d = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, d), "wb") as f:
            f.write(data)
        return "sha256:" + d, len(data)

    layers = []
    for spec in sys.argv[4:]:
        path, rest = spec.split(":", 1)
        diff_id, media_type = rest.rsplit(":", 1)
        digest, size = put_file(path)
        layers.append({"mediaType": media_type, "digest": digest, "size": size, "diff_id": diff_id})
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"], "Cmd": cmd},
        "rootfs": {"type": "layers", "diff_ids": [l["diff_id"] for l in layers]},
    }
    cd, cs = put(json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs},
        "layers": [{"mediaType": l["mediaType"], "digest": l["digest"], "size": l["size"]} for l in layers],
    }
    md, ms = put(json.dumps(manifest, sort_keys=True).encode())
    index_path = os.path.join(layout, "index.json")
    index = {"schemaVersion": 2, "manifests": []}
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
    index["manifests"] = [m for m in index["manifests"]
                          if m.get("annotations", {}).get("org.opencontainers.image.ref.name") != tag]
    index["manifests"].append({"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md,
                               "size": ms, "annotations": {"org.opencontainers.image.ref.name": tag}})
    with open(index_path + ".tmp", "w") as f:
        json.dump(index, f)
    os.rename(index_path + ".tmp", index_path)
    with open(os.path.join(layout, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    print(md)


if __name__ == "__main__":
    main()
