# Reads vendor-data documents with cloud-init's own library, as cloud-init 22.4 does on a
# guest: user_data.convert_string decides the form, UserDataProcessor.process splits and
# types the parts, util.fully_decoded_payload decodes each, and the cloud-config handler
# (CloudConfigPartHandler) loads each cloud-config part with cloud-init's safeyaml and
# merges them with its default mergers. No service runs; nothing is written.
#
# Input: a JSON list of documents on stdin. Output: one JSON object per document, with the
# YAML values typed ({"t": "int", "v": "420"}), so that 420, "0644" and true differ.
import json
import logging
import sys

logging.disable(logging.CRITICAL)  # cloud-init logs the parts it drops; we report them

from cloudinit import handlers, safeyaml, user_data, util  # noqa: E402
from cloudinit.handlers.cloud_config import CloudConfigPartHandler  # noqa: E402
from cloudinit.settings import PER_ALWAYS  # noqa: E402


# `#include` parts make UserDataProcessor fetch URLs: the test sends no traffic, so the
# fetch is replaced by a record of the URL (cloud-init's own handling of a failed fetch
# follows: a logged warning, no part).
INCLUDES = []


def no_fetch(url, *_args, **_kwargs):
    INCLUDES.append(url)
    raise user_data.UrlError(ValueError("not fetched by the parity test"), url=url)


user_data.read_file_or_url = no_fetch


class NoPaths:
    """The handler asks where it would write the merged config: nowhere."""

    def get_ipath(self, name=None):
        return None


def typed(value):
    if value is None:
        return {"t": "null"}
    if isinstance(value, bool):
        return {"t": "bool", "v": value}
    if isinstance(value, int):
        return {"t": "int", "v": str(value)}
    if isinstance(value, float):
        if value != value:
            return {"t": "float", "v": "nan"}
        if value in (float("inf"), float("-inf")):
            return {"t": "float", "v": "inf" if value > 0 else "-inf"}
        return {"t": "float", "v": repr(value)}  # parsed exactly on the Rust side
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates, which JSON cannot carry
            return {"t": "str-surrogates", "hex": value.encode("utf-8", "surrogatepass").hex()}
        return {"t": "str", "v": value}
    if isinstance(value, list):
        return {"t": "list", "v": [typed(v) for v in value]}
    if isinstance(value, dict):
        return {"t": "map", "v": [[typed(k), typed(v)] for k, v in value.items()]}
    return {"t": type(value).__name__, "v": repr(value)}


def read(text):
    data = text.encode("utf-8")
    del INCLUDES[:]
    base = user_data.convert_string(data)
    form = "plain" if base.get_content_type() == "text/x-not-multipart" else "multipart"
    defects = [type(d).__name__ for part in base.walk() for d in part.defects]
    processed = user_data.UserDataProcessor({}).process(data)
    handler = CloudConfigPartHandler(NoPaths())
    handler.handle_part(None, handlers.CONTENT_START, None, None, None, None)
    parts = []
    for part in processed.walk():
        if part.get_content_maintype() == "multipart":
            continue
        ctype = part.get_content_type()
        payload = util.fully_decoded_payload(part)
        if isinstance(payload, bytes):
            payload = payload.decode("utf-8", "surrogateescape")
        entry = {
            "type": ctype,
            "filename": part.get_filename(),
            "payload_hex": payload.encode("utf-8", "surrogateescape").hex(),
        }
        if ctype == "text/cloud-config":
            try:
                doc = safeyaml.load(payload)
                if doc is None:
                    entry["config"] = None
                elif isinstance(doc, dict):
                    entry["config"] = typed(doc)
                else:
                    entry["yaml_error"] = "top level is " + type(doc).__name__
            except Exception as e:  # what cloud-init's load_yaml catches and logs
                entry["yaml_error"] = "%s: %s" % (type(e).__name__, e)
            headers = dict(part)
            headers["Content-Type"] = ctype
            handler.handle_part(
                None, ctype, part.get_filename(), payload, PER_ALWAYS, headers
            )
        parts.append(entry)
    merged = handler.cloud_buf if handler.cloud_buf is not None else {}
    return {
        "form": form,
        "defects": defects,
        "parts": parts,
        "merged": typed(merged),
        "includes": list(INCLUDES),
    }


def read_or_fail(text):
    try:
        return read(text)
    except Exception as e:
        return {"error": "%s: %s" % (type(e).__name__, e)}


docs = json.load(sys.stdin)
json.dump([read_or_fail(d) for d in docs], sys.stdout)
