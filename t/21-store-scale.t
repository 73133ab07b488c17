#!/usr/bin/perl

# A store folder with 1,000 saved sessions: indexed at start, listed by the
# API, and evicted least recently used first down to max_files; and a slow
# save while other requests wait behind it.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use Digest::SHA qw(sha256_hex);
use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep time);

my $JSON = $LlamaTest::JSON;

my $t = LlamaTest->new(workers => 2);
my $slots = $t->dir . '/slots';
mkdir $slots;

my $fp = LlamaTest::fake_fp('fake.gguf');
my $now = time;

# 1,000 sessions, session 0 the oldest
for my $i (0 .. 999) {
    my $name = sprintf 'bulk%04d-%024x.%s', $i, $i, $fp;
    open my $fh, '>', "$slots/$name.bin" or die;
    print $fh $JSON->encode({ text => "session $i", n => 10 });
    close $fh;
    utime $now - 2000 + $i, $now - 2000 + $i, "$slots/$name.bin";
}

$t->fake;
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:4m store=%%SLOTS%% max_files=990;',
    server => q{
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Wait $llama_session_wait_ms always;
    },
    extra => 'location /api/ { llama_session_api llama; }'));

ok($t->log_lines(qr/llama_session zone "llama": 1000 saved sessions/),
   'the index at start has the 1,000 files');
my @evicted = $t->log_lines(qr/evicted session "bulk\d+/);
is(scalar @evicted, 10, 'ten were evicted to keep max_files=990');
is_deeply([ sort map { /"(bulk\d+)/ } @evicted ],
          [ map { sprintf 'bulk%04d', $_ } 0 .. 9 ],
          'the ten least recently used ones');
my @bins = glob("$slots/*.bin");
is(scalar @bins, 990, '990 files are left');
ok($t->wait_for(sub { !-e sprintf("$slots/bulk0009-%024x.$fp.bin", 9) }, 5),
   'the 10th oldest is gone');
ok(-e sprintf("$slots/bulk0010-%024x.$fp.bin", 10), 'the 11th oldest stays');

my $list = $t->get('/api/sessions')->{json};
is($list->{files}, 990, 'the API lists 990 sessions');
is(scalar @{ $list->{sessions} }, 990, 'all of them');
is($list->{sessions}[0]{key}, sprintf('bulk0999-%024x', 999),
   'the most recently used first');

# a new session's file makes the oldest left go
my $chat = { messages => [ { role => 'user', content => 'hi' } ] };
$t->post('/v1/chat/completions', $chat, headers => { 'X-Session-Id' => 'n1' });
$t->post('/v1/chat/completions', $chat, headers => { 'X-Session-Id' => 'n2' });
ok($t->wait_for(sub { !-e sprintf("$slots/bulk0010-%024x.$fp.bin", 10) }, 5),
   'a new file evicts the least recently used one');
is(scalar(my @b = glob("$slots/*.bin")), 990, 'still 990 files');

# a slow save: the others wait behind it, in order, and are served
$t->post('/v1/chat/completions', $chat, headers => { 'X-Session-Id' => 'slow' });
$t->fake_script({ save => { delay_ms => 1500 } });
my $t0 = time;
my @h = map { $t->async_post('/v1/chat/completions', $chat,
                             headers => { 'X-Session-Id' => "w$_" }) } 1 .. 3;
my @r = map { $t->async_wait($_) } @h;
is(scalar(grep { $_->{status} == 200 } @r), 3,
   'three requests behind a slow save are all served');
cmp_ok((sort { $b <=> $a } map { $_->{headers}{'x-s-wait'} } @r)[0], '>=', 1000,
       'they waited for it');
$t->fake_script({});

$t->stop;
done_testing;
