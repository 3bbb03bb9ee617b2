"""Images for vision-language verifiers (Qwen3-VL): references, loading, and the model's inputs.

In a normalised conversation an image is a content part

    {"type": "image", "image": "<absolute path or data: URL>", "sha256": "<first 16 hex of its bytes>"}

next to text parts {"type": "text", "text": ...}; Qwen3-VL's chat template renders it as
`<|vision_start|><|image_pad|><|vision_end|>`. The digest makes conversation ids and hidden-state
keys follow the image's content, not its path.

What an image may be (hostile or careless data must never hang, exhaust memory or escape its folder):
- a local image is read only from a regular file (a FIFO would block, a device such as /dev/zero
  would read forever; both are refused before and after opening) of at most MAX_IMAGE_BYTES
  (32 MiB), with a bounded read; a data: URL's payload has the same limit;
- its pixel count is held to PIL's decompression-bomb limit (`PIL.Image.MAX_IMAGE_PIXELS`): an image
  above it, even in the band where PIL only warns, is rejected;
- from a data file, a local image (relative path, absolute path or file:// URL), symlinks resolved,
  must lie inside an allowed root: the data file's folder (the working directory for dataset rows)
  or a folder named with `--image-root`.
A rejected image rejects its row (counted with the reason); `load_image` raises one SpeculatorsError.

The model inputs are built here, not by transformers' `Qwen3VLProcessor`: that class cannot be
constructed without torchvision (its video processor is checked against a torchvision-only base
class), and torchvision has no build for the CPU torch 2.13.0 wheel this project installs. The
image processor's PIL backend needs none, and expanding each image's placeholder to its
grid_t * grid_h * grid_w / merge_size**2 tokens is the processor's whole text-side job.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import stat
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from speculators.errors import SpeculatorsError, shorten

if TYPE_CHECKING:
    import torch
    from PIL import Image

VISION_LANGUAGE_TYPES = ("qwen3_vl", "qwen3_vl_moe")
MAX_IMAGES_PER_PROMPT = 4  # what vLLM's engine is profiled for (limit_mm_per_prompt)
DATA_URL_PREFIX = "data:image/"
MAX_IMAGE_BYTES = 32 * 1024 * 1024  # an encoded image (file or data: URL payload) larger than this is refused
# Rejection reasons (report keys; the row's location goes to the examples).
NOT_A_REGULAR_FILE = "image is not a regular file"
TOO_MANY_PIXELS = "image has more pixels than PIL's decompression-bomb limit"
OUTSIDE_ROOTS = "image outside the data folder (allow its folder with --image-root)"


class ImageRejected(Exception):
    """An image reference that cannot be used; the message is the reason shown in the report."""


class NotARegularFile(OSError):
    """A path that is a FIFO, device, directory or socket; `kind` says which."""

    def __init__(self, path: Path, kind: str):
        super().__init__(f"{path} is {kind}, not a regular file")
        self.kind = kind


def file_kind(mode: int) -> str | None:
    """What a non-regular file is (None for a regular file)."""
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    )
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in kinds if test(mode)), "a special file")


def open_regular_file(path: Path) -> IO[bytes]:
    """`path` opened for reading only if it is a regular file: checked before opening (opening a FIFO
    blocks until a writer comes) and again on the open descriptor (non-blocking, so a file swapped for
    a FIFO in between cannot hang). NotARegularFile otherwise; other OSErrors pass through."""
    kind = file_kind(os.stat(path).st_mode)
    if kind:
        raise NotARegularFile(path, kind)
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        kind = file_kind(os.fstat(descriptor).st_mode)
        if kind:
            raise NotARegularFile(path, kind)
        if hasattr(os, "set_blocking"):
            os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def size_text(count: int) -> str:
    """A byte count as the limits are written: 32 MiB, 4 KiB, 100 bytes."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size and count % size == 0:
            return f"{count // size} {unit}"
    return f"{count} bytes"


def too_large() -> str:
    return f"image larger than {size_text(MAX_IMAGE_BYTES)}"


def image_bytes(reference: str) -> bytes:
    """The encoded bytes of an image given as an absolute path, a file:// URL or a data: URL, read only
    from a regular file and never more than MAX_IMAGE_BYTES."""
    if reference.startswith(DATA_URL_PREFIX):
        header, _, payload = reference.partition(",")
        if not header.endswith(";base64"):
            raise ImageRejected("image data URL is not base64 (expected data:image/<type>;base64,...)")
        if len(payload) // 4 * 3 > MAX_IMAGE_BYTES:  # (the decoded size, within padding)
            raise ImageRejected(too_large())
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error:
            raise ImageRejected("image data URL has invalid base64") from None
        if len(data) > MAX_IMAGE_BYTES:
            raise ImageRejected(too_large())
        return data
    path = Path(reference.removeprefix("file://"))
    try:
        with open_regular_file(path) as handle:
            data = handle.read(MAX_IMAGE_BYTES + 1)
    except FileNotFoundError:
        raise ImageRejected(f"image {path} does not exist") from None
    except NotARegularFile:
        raise ImageRejected(NOT_A_REGULAR_FILE) from None
    except OSError as error:
        raise ImageRejected(f"image {path} cannot be read ({error.strerror or error})") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageRejected(too_large())
    return data


def decode_image(data: bytes, label: str) -> Image.Image:
    """The RGB image of encoded bytes. PIL's decompression-bomb check is an error here in its warning
    band too (between MAX_IMAGE_PIXELS and twice that PIL only warns, and would decode it)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                image.load()
                return image.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageRejected(TOO_MANY_PIXELS) from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise ImageRejected(f"image {label} is not a readable image ({str(error).splitlines()[0][:120]})") from None


def resolve_reference(raw: Any, base_dir: Path | None) -> str:
    """An absolute path or a data: URL for a raw reference (a path relative to `base_dir`, a
    file:// URL, a data: URL); remote URLs are refused, since nothing is downloaded."""
    if not isinstance(raw, str) or not raw.strip():
        raise ImageRejected("image reference is not a non-empty string")
    raw = raw.strip()
    if raw.startswith(DATA_URL_PREFIX):
        return raw
    if raw.startswith(("http://", "https://")):
        raise ImageRejected(f"image {raw[:80]} is a remote URL; download it and give the local path")
    path = Path(raw.removeprefix("file://")).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    return str(path.resolve())


def check_inside_roots(reference: str, base_dir: Path | None, roots: Sequence[str | Path]) -> None:
    """ImageRejected unless a resolved local reference lies inside `base_dir` (the working directory
    when None) or one of `roots`: a data file must not reach a file elsewhere on disk by `../` or an
    absolute path unless the user allowed that folder."""
    if reference.startswith(DATA_URL_PREFIX):
        return
    path = Path(reference)
    allowed = [base_dir or Path.cwd(), *map(Path, roots)]
    if not any(path.is_relative_to(Path(root).expanduser().resolve()) for root in allowed):
        raise ImageRejected(OUTSIDE_ROOTS)


def image_part(raw: Any, base_dir: Path | None = None, roots: Sequence[str | Path] = ()) -> dict[str, str]:
    """The normalised content part of one image, checked to lie inside `base_dir` or `roots` and to
    decode; ImageRejected with the reason."""
    reference = resolve_reference(raw, base_dir)
    check_inside_roots(reference, base_dir, roots)
    data = image_bytes(reference)
    decode_image(data, reference if not reference.startswith(DATA_URL_PREFIX) else "(data URL)")
    return {"type": "image", "image": reference, "sha256": hashlib.sha256(data).hexdigest()[:16]}


def load_image(part: dict[str, str]) -> Image.Image:
    """The RGB image of a normalised image part, re-checked (the file may have changed since prepare) with
    prepare's file, size and pixel checks (its folder was checked then); one SpeculatorsError if unusable."""
    reference = part["image"]
    label = shorten(reference, 200)  # (a path whole, as the battery names it; a data URL cut)
    try:
        data = image_bytes(reference)
        if hashlib.sha256(data).hexdigest()[:16] != part.get("sha256"):
            raise SpeculatorsError(f"image {label} changed since the data were prepared; run prepare again")
        return decode_image(data, label)
    except ImageRejected as reason:
        text = str(reason) if label in str(reason) else f"image {label} cannot be used ({reason})"
        raise SpeculatorsError(f"{text}; restore it or run prepare again") from None


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The image parts of a conversation, in order."""
    return [
        part
        for message in messages
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "image"
    ]


def images_digest(images: list[dict[str, str]]) -> str:
    return ",".join(part["sha256"] for part in images)


def collapse_placeholders(input_ids: list[int], image_token_id: int) -> list[int]:
    """Each run of image placeholder tokens -> one placeholder (the form vLLM's processor expands)."""
    return [t for i, t in enumerate(input_ids) if t != image_token_id or i == 0 or input_ids[i - 1] != image_token_id]


def openai_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for an OpenAI-compatible server (vLLM's /v1/chat/completions): each image part as an
    `image_url` part holding a data URL of its bytes (the server needs no access to local paths)."""
    converted = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [openai_part(part) for part in content]
        converted.append({**message, "content": content})
    return converted


def openai_part(part: dict[str, str]) -> dict[str, Any]:
    if part.get("type") != "image":
        return part
    reference = part["image"]
    if not reference.startswith(DATA_URL_PREFIX):
        from PIL import Image

        data = image_bytes(reference)
        with Image.open(io.BytesIO(data)) as image:
            kind = (image.format or "png").lower()
        reference = f"data:image/{kind};base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": reference}}


def request_images(messages: list[dict[str, Any]]) -> list[Image.Image]:
    """The images of OpenAI-format messages (image_url parts with data URLs, as openai_messages writes)."""
    images = []
    for message in messages:
        if isinstance(message.get("content"), list):
            for part in message["content"]:
                if part.get("type") == "image_url":
                    url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
                    images.append(decode_image(image_bytes(url), "(request image)"))
    return images


def vllm_vision_support() -> str | None:
    """Why this installation's vLLM cannot load a Qwen3-VL model (None when it can): vLLM's model
    module imports transformers' torchvision image processor at import time."""
    try:
        import torchvision  # type: ignore[import-not-found]  # noqa: F401
    except Exception as error:  # missing, or a build for another torch (its C++ ops fail to register)
        return (
            f"vLLM loads Qwen3-VL only with torchvision, which cannot be imported here ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:120] if str(error) else 'no module'}); install the torchvision build "
            f"that matches this torch (CUDA machines: the one pip pairs with vLLM's torch)"
        )
    return None


def is_vision_language(model_type: str) -> bool:
    return model_type in VISION_LANGUAGE_TYPES


# ----- model inputs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class VisionTokens:
    """The verifier's image placeholder id and its vision tower's spatial merge."""

    image_token_id: int
    spatial_merge_size: int

    @classmethod
    def from_config(cls, config: Any) -> VisionTokens:
        try:
            return cls(int(config.image_token_id), int(config.vision_config.spatial_merge_size))
        except AttributeError as error:
            raise SpeculatorsError(f"the verifier config lacks a vision-language field ({error.name})") from None


class ImageInputs:
    """The image processor (PIL backend) of a vision-language verifier directory, and the inputs its
    model takes: expanded placeholders, pixel values, grids, token types, and M-RoPE positions."""

    def __init__(self, model_dir: str | Path, config: Any):
        from transformers import AutoImageProcessor

        self.tokens = VisionTokens.from_config(config)
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil", trust_remote_code=False)
        except (OSError, ValueError) as error:
            raise SpeculatorsError(
                f"verifier {model_dir} has no usable image processor ({str(error).splitlines()[0][:160]}); "
                f"it needs the preprocessor_config.json of its Hugging Face repository"
            ) from None

    def grid(self, image: Image.Image) -> list[int]:
        """[t, h, w] patch grid of one image as the processor resizes it (its own smart_resize on the
        image's size: no pixels are processed; one frame, so t = 1)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        p = self.processor
        height, width = smart_resize(
            image.height,
            image.width,
            p.patch_size * p.merge_size,
            min_pixels=p.size["shortest_edge"],
            max_pixels=p.size["longest_edge"],
        )
        return [1, height // p.patch_size, width // p.patch_size]

    def token_count(self, grid_thw: list[int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.tokens.spatial_merge_size**2

    def expand(self, input_ids: list[int], loss_mask: list[int], grids: list[list[int]]) -> tuple[list[int], list[int]]:
        """Each image placeholder (one token per image, as the chat template renders it) expanded to
        its image's token count; the expanded positions are never supervised."""
        pad = self.tokens.image_token_id
        found = input_ids.count(pad)
        if found != len(grids):
            raise SpeculatorsError(
                f"the rendered conversation has {found} image placeholders for {len(grids)} images; the chat "
                f"template must render each image part once"
            )
        ids: list[int] = []
        mask: list[int] = []
        remaining = iter(grids)
        for token, supervised in zip(input_ids, loss_mask, strict=True):
            if token == pad:
                count = self.token_count(next(remaining))
                ids += [pad] * count
                mask += [0] * count
            else:
                ids.append(token)
                mask.append(supervised)
        return ids, mask

    def pixel_inputs(self, images: list[Image.Image]) -> dict[str, torch.Tensor]:
        """pixel_values [patches, C*T*P*P] and image_grid_thw [images, 3] of images in order."""
        out = self.processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """mm_token_type_ids: 1 at image positions, 0 elsewhere (no video inputs here)."""
        return (input_ids == self.tokens.image_token_id).long()

    def drafter_positions(self, input_ids: list[int], grids: list[list[int]]) -> list[int]:
        """The temporal row of the verifier's M-RoPE positions, one per token: what vLLM passes to a
        1-D-RoPE drafter for a multimodal target (text advances one per token; an image's tokens
        share its start position, and the text after it resumes max(h, w) / merge later)."""
        pad, merge = self.tokens.image_token_id, self.tokens.spatial_merge_size
        positions: list[int] = []
        remaining = iter(grids)
        current = index = 0
        while index < len(input_ids):
            if input_ids[index] != pad:
                positions.append(current)
                current += 1
                index += 1
                continue
            grid = next(remaining)
            count = self.token_count(grid)
            positions += [current] * count  # t = 1 for an image: one temporal index
            _, h, w = grid
            current += max(h, w) // merge
            index += count
        if len(positions) != len(input_ids):
            raise SpeculatorsError("an image's placeholder run is shorter than its token count; prepare the data again")
        return positions
