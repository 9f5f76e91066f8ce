"""The update under backward (``update_in_backward``): each chunk updates as soon as backward has made its
gradients final, and ``step()`` keeps the result when nothing it read has changed since.

- ``overlap``: the hooks on backward and the chunks' updates launched from them;
- ``aside``: the device strategy's update into a spare buffer, and the fingerprints of what it read;
- ``updates``: one chunk's update started under backward, what it read, and why ``step()`` may not keep it;
- ``switch``: whether chunks update under backward, for ``"auto"``: where this run's own steps show it pays.
"""
