"""Images in requests: where a body puts them (chat `image_url` parts, Responses `input_image`,
Anthropic image blocks, TGI's markdown `![](…)`), how they are fetched (off by default; an
address policy so the server is no SSRF proxy) and decoded (Pillow, bounded before any pixel is
decoded), and what a model makes of them (`vision_model`: refused for text models; `families`:
each served family's image processor port (`qwen2_vl`, `llava_next`, `siglip`) and prompt
rendering). Every refusal is an `ImageError`: a 422 naming the image and the reason."""
