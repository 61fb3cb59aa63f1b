"""A chat session across ranks: every rank runs the same `ChatSession` on rank 0's lines, and
rank 0 alone, which holds the vision tower and the image files, checks an attached image and
prepares each prompt; the others take its outcome and its expanded prompt over the group."""

from __future__ import annotations

from ..chat.session import ChatSession
from ..model.vision.preprocess import image_reference
from .lines import share_line


class SharedChatSession(ChatSession):
    """`ChatSession` for a model loaded over a group (`group`: its `RankGroup`, which prepares
    each prompt on rank 0 and shares it)."""

    def attach(self, image) -> None:
        """Rank 0 checks and queues the image; its error (one line, shared with two
        `all_sum`s) is raised on every rank, so every rank's queue stays alike."""
        link, error = self.group.link, None
        if link.rank == 0:
            try:
                super().attach(image)
            except (ValueError, OSError) as e:
                error = e
        message = share_line(link, str(error).splitlines()[0] if error is not None else "")
        if error is not None:
            raise error
        if message:
            raise ValueError(message)
        if link.rank != 0:
            self.attached.append(image_reference(image))
