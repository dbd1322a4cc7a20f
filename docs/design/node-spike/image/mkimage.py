#!/usr/bin/env python3
"""Write a single-layer OCI image archive by hand (no daemon, no registry).

usage: mkimage.py OUT.tar NAME:TAG CMD_JSON SRC=DEST [SRC=DEST|@LINK=TARGET ...]
  SRC=DEST       copy file SRC into the image at DEST (mode kept)
  @DEST=TARGET   make symlink DEST -> TARGET in the image
The archive carries the annotation io.containerd.image.name=NAME:TAG, so
`ctr -n k8s.io images import OUT.tar` registers it under that name.
"""
import gzip, hashlib, io, json, os, sys, tarfile

def sha(b): return "sha256:" + hashlib.sha256(b).hexdigest()

def add_dirs(tf, seen, path):
    parts = path.strip("/").split("/")[:-1]
    for i in range(1, len(parts) + 1):
        d = "/".join(parts[:i])
        if d in seen: continue
        seen.add(d)
        ti = tarfile.TarInfo(d); ti.type = tarfile.DIRTYPE; ti.mode = 0o755; ti.mtime = 0
        tf.addfile(ti)

def main():
    out, ref, cmd = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
        seen = set()
        for spec in sys.argv[4:]:
            if spec.startswith("@"):
                dest, target = spec[1:].split("=", 1)
                add_dirs(tf, seen, dest)
                ti = tarfile.TarInfo(dest.strip("/")); ti.type = tarfile.SYMTYPE
                ti.linkname = target; ti.mode = 0o777; ti.mtime = 0
                tf.addfile(ti)
            else:
                src, dest = spec.split("=", 1)
                add_dirs(tf, seen, dest)
                data = open(src, "rb").read()
                ti = tarfile.TarInfo(dest.strip("/")); ti.size = len(data)
                ti.mode = os.stat(src).st_mode & 0o7777; ti.mtime = 0
                tf.addfile(ti, io.BytesIO(data))
    layer_raw = raw.getvalue()
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0) as g: g.write(layer_raw)
    layer = gz.getvalue()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": cmd, "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [sha(layer_raw)]},
        "history": [{"created_by": "node-spike mkimage.py"}],
    }, separators=(",", ":")).encode()
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": sha(layer), "size": len(layer)}],
    }, separators=(",", ":")).encode()
    tag = ref.rsplit(":", 1)[1]
    index = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": sha(manifest), "size": len(manifest),
                       "platform": {"architecture": "amd64", "os": "linux"},
                       "annotations": {"io.containerd.image.name": ref,
                                       "org.opencontainers.image.ref.name": tag}}],
    }, separators=(",", ":")).encode()
    with tarfile.open(out, "w") as tf:
        def put(name, data):
            ti = tarfile.TarInfo(name); ti.size = len(data); ti.mode = 0o644; ti.mtime = 0
            tf.addfile(ti, io.BytesIO(data))
        for d in ("blobs", "blobs/sha256"):
            ti = tarfile.TarInfo(d); ti.type = tarfile.DIRTYPE; ti.mode = 0o755; ti.mtime = 0
            tf.addfile(ti)
        put("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        for blob in (layer, config, manifest):
            put("blobs/sha256/" + hashlib.sha256(blob).hexdigest(), blob)
        put("index.json", index)
    print(f"{out}: {ref} manifest {sha(manifest)}")

main()
