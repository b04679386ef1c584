"""Package data: fallback chat templates, passkey filler, needle and long-document prompts."""

if __name__ == "prompts":  # run from the checkout's root: a package of that name, not this one
    import os

    from kvrun.top_level import hand_over

    hand_over(__name__, os.path.dirname(__file__))
