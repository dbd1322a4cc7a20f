# Writes multipart documents with cloud-init's own `devel make-mime` code
# (create_mime_message), one per list of (file name, content, type) on stdin.
import io
import json
import random
import sys

from cloudinit.cmd.devel.make_mime import create_mime_message

# The generator draws its boundaries from `random`: seeded, the documents are the same
# on every run.
random.seed(36)
out = []
for files in json.load(sys.stdin):
    message, errors = create_mime_message(
        [(io.StringIO(content), name, kind) for name, content, kind in files]
    )
    if errors:
        raise SystemExit("; ".join(errors))
    out.append(message.as_string())
json.dump(out, sys.stdout)
