// The app's overlay of where the model looked, drawn from pipeline_map.onnx's outputs with no
// Python: the map upsampled as Pillow's bilinear resize does, coloured through the graph's
// map_colours, blended half and half over the image (vit_hub.explain.rollout.overlay) at the
// size the app shows it (vit_hub.demo.pictures.for_display). One file for both JavaScript
// apps: the static Space's page.js and examples/node/classify.mjs import it.
const ALPHA = 0.5; // the heat map's weight in the blend
const DISPLAY_MIN_SIDE = 280; // a smaller image is enlarged by a whole factor, sharp pixels
const DISPLAY_MAX_SIDE = 1024; // a larger one is shrunk to this longer side

// Pillow's taps for resizing one axis bilinearly: per output pixel [first input, weights].
function bilinearTaps(inSize, outSize) {
  const scale = inSize / outSize;
  const support = Math.max(scale, 1);
  return Array.from({ length: outSize }, (_, x) => {
    const centre = (x + 0.5) * scale;
    const first = Math.max(Math.trunc(centre - support + 0.5), 0);
    const last = Math.min(Math.trunc(centre + support + 0.5), inSize);
    const weights = [];
    for (let i = first; i < last; i++) weights.push(Math.max(0, 1 - Math.abs((i - centre + 0.5) / support)));
    const total = weights.reduce((sum, weight) => sum + weight, 0);
    return [first, weights.map((weight) => weight / total)];
  });
}

// float [height][width] planes (channels interleaved) resized by Pillow's two passes, width first.
function resizeBilinear(values, height, width, channels, outHeight, outWidth) {
  const across = new Float32Array(height * outWidth * channels);
  bilinearTaps(width, outWidth).forEach(([first, weights], x) => {
    for (let y = 0; y < height; y++) for (let c = 0; c < channels; c++) {
      let sum = 0;
      weights.forEach((weight, i) => { sum += values[(y * width + first + i) * channels + c] * weight; });
      across[(y * outWidth + x) * channels + c] = sum;
    }
  });
  const down = new Float32Array(outHeight * outWidth * channels);
  bilinearTaps(height, outHeight).forEach(([first, weights], y) => {
    for (let x = 0; x < outWidth * channels; x++) {
      let sum = 0;
      weights.forEach((weight, i) => { sum += across[(first + i) * outWidth * channels + x] * weight; });
      down[y * outWidth * channels + x] = sum;
    }
  });
  return down;
}

// The (width, height) the app shows an image of this size at.
export function displaySize(width, height) {
  const longer = Math.max(width, height);
  if (longer < DISPLAY_MIN_SIDE) {
    const factor = Math.ceil(DISPLAY_MIN_SIDE / longer);
    return [width * factor, height * factor];
  }
  if (longer > DISPLAY_MAX_SIDE) {
    const scale = DISPLAY_MAX_SIDE / longer;
    // Python's round, as display_size: a half to even (2048x1025 is shown at 1024x512)
    return [Math.max(1, roundHalfEven(width * scale)), Math.max(1, roundHalfEven(height * scale))];
  }
  return [width, height];
}

// uint8 pixels [height, width, channels] (1-4) -> {rgb, width, height} as the app shows them:
// alpha over white and gray as Pillow computes them (as the graph does), a small image enlarged
// with sharp pixels to its display size. A larger one the caller shrinks to its display size
// first, with its own resize (the app shrinks bilinearly).
export function forDisplay(pixels, height, width, channels, gray) {
  const [outWidth, outHeight] = displaySize(width, height);
  const factor = outWidth / width;
  const rgb = new Float32Array(outHeight * outWidth * 3);
  for (let y = 0; y < outHeight; y++) for (let x = 0; x < outWidth; x++) {
    const at = (Math.floor(y / factor) * width + Math.floor(x / factor)) * channels;
    const alpha = channels % 2 === 0 ? pixels[at + channels - 1] : 255;
    const colour = [0, 1, 2].map((c) => overWhite(pixels[at + (channels >= 3 ? c : 0)], alpha));
    const level = Math.floor((19595 * colour[0] + 38470 * colour[1] + 7471 * colour[2] + 32768) / 65536);
    for (let c = 0; c < 3; c++) rgb[(y * outWidth + x) * 3 + c] = gray ? level : colour[c];
  }
  return { rgb, width: outWidth, height: outHeight };
}

// Pillow's alpha_composite of one channel over white, in its fixed point.
function overWhite(value, alpha) {
  if (alpha === 255) return value;
  const scaled = 128 * (value * alpha + 255 * (255 - alpha)) + 16384;
  return Math.floor(Math.floor((Math.floor(scaled / 256) + scaled) / 256) / 128);
}

// NumPy's and Python's round: halves to even.
function roundHalfEven(value) {
  const rounded = Math.round(value);
  return Math.abs(value % 1) === 0.5 && rounded % 2 !== 0 ? rounded - 1 : rounded;
}

// The overlay: uint8 RGB [height, width, 3] of `shown` ({rgb, width, height}) with the map
// [gridH, gridW] in [0, 1] over it, coloured by `colours` (uint8 [256, 3], map_colours).
export function overlay(shown, map, gridH, gridW, colours) {
  const clipped = Float32Array.from(map, (v) => Math.min(1, Math.max(0, v)));
  const heat = resizeBilinear(clipped, gridH, gridW, 1, shown.height, shown.width);
  const out = new Uint8Array(shown.width * shown.height * 3);
  for (let p = 0; p < shown.width * shown.height; p++) {
    const index = roundHalfEven(Math.fround(heat[p] * 255));
    for (let c = 0; c < 3; c++) {
      const base = shown.rgb[p * 3 + c];
      out[p * 3 + c] = Math.trunc(base + ALPHA * (colours[index * 3 + c] - base));
    }
  }
  return out;
}
